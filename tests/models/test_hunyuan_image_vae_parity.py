"""Native HunyuanImage 2.1 VAE against Diffusers' `AutoencoderKLHunyuanImage` on the same tiny random
weights: decode (whole and tiled, non-square) and encode, batch of 2."""

from __future__ import annotations

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_hunyuan_image import (
    HUNYUAN_IMAGE_VAE_CONFIG_DEFAULTS,
    AutoencoderKLHunyuanImage,
)
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0
TINY = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 8,
    "block_out_channels": (32, 32, 64),
    "layers_per_block": 1,
    "spatial_compression_ratio": 4,
    "sample_size": 16,
    "scaling_factor": 0.75,
}


@pytest.fixture(scope="module")
def pair():
    reference, native = parity_pair(diffusers.AutoencoderKLHunyuanImage, AutoencoderKLHunyuanImage, TINY)
    assert_same_state_dict_layout(native, reference)
    return reference, native


def test_config_defaults_cover_diffusers_keys() -> None:
    import inspect

    keys = set(inspect.signature(diffusers.AutoencoderKLHunyuanImage.__init__).parameters) - {"self"}
    assert keys == set(HUNYUAN_IMAGE_VAE_CONFIG_DEFAULTS)


def test_decode_matches(pair) -> None:
    reference, native = pair
    z = torch.randn(2, 8, 6, 10, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference.decode(z).sample
        got = native.decode(z)
        reference.enable_tiling()
        native.enable_tiling()
        try:
            want_tiled = reference.decode(z).sample
            got_tiled = native.decode(z)
        finally:
            reference.disable_tiling()
            native.disable_tiling()
    assert got.shape == (2, 3, 24, 40)
    assert_parity(got, want, "HunyuanImage VAE decode", min_db=MIN_DB)
    assert_parity(got_tiled, want_tiled, "HunyuanImage VAE tiled decode", min_db=MIN_DB)
    assert (got_tiled - got).abs().max() > 1e-4  # tiling took its own path


def test_encode_matches(pair) -> None:
    reference, native = pair
    x = torch.rand(2, 3, 16, 24, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        want = reference.encode(x).latent_dist
        got = native.encode(x)
    assert_parity(got.mean, want.mean, "HunyuanImage VAE encode mean", min_db=MIN_DB)
    assert_parity(got.logvar, want.logvar, "HunyuanImage VAE encode logvar", min_db=MIN_DB)
