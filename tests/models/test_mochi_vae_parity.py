"""Native Mochi VAE decoder against Diffusers' `AutoencoderKLMochi` on the same tiny random weights: the
default one-piece decode (the first `temporal_compression - 1` frames dropped) at several frame counts, a
batch of two, tiled decode with small tiles, and the released layout's state-dict keys on the meta device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_mochi import MOCHI_VAE_CONFIG_DEFAULTS, AutoencoderKLMochi
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair
from diffserve.testing.vae_parity import assert_config_defaults_are_diffusers, weight_noise

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0

#: The released layout's kinds of level (6x temporal: 1, 2, 3; 8x spatial) at a tiny width.
TINY: dict[str, Any] = {
    "encoder_block_out_channels": (32, 32, 32, 64),
    "decoder_block_out_channels": (32, 32, 32, 64),
    "latent_channels": 4,
    "layers_per_block": (1, 1, 1, 1, 1),
    "latents_mean": (0.1, -0.2, 0.05, 0.0),
    "latents_std": (0.9, 1.1, 1.3, 0.8),
}


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLMochi]:
    return parity_pair(diffusers.AutoencoderKLMochi, AutoencoderKLMochi, TINY, perturb=weight_noise(0.02))


def test_config_defaults_are_diffusers() -> None:
    assert_config_defaults_are_diffusers(diffusers.AutoencoderKLMochi, MOCHI_VAE_CONFIG_DEFAULTS)


def test_state_dict_layout(pair) -> None:
    ref, ours = pair
    assert_same_state_dict_layout(ours, ref)


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLMochi()
        ours = AutoencoderKLMochi.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)
    assert ours.spatial_compression_ratio == 8 and ours.temporal_compression_ratio == 6


@pytest.mark.parametrize(("batch", "frames"), [(1, 1), (1, 2), (2, 4)])
def test_decode_matches(pair, batch: int, frames: int) -> None:
    ref, ours = pair
    z = torch.randn(batch, 4, frames, 3, 5, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want = ref.decode(z).sample
        got = ours.decode(z)
    assert got.shape == want.shape
    assert_parity(got, want, f"mochi vae decode {batch} x {frames} latent frames", min_db=MIN_DB)


def test_tiled_decode_matches(pair) -> None:
    ref, ours = pair
    z = torch.randn(1, 4, 2, 7, 9, generator=torch.Generator().manual_seed(7))
    tiles = {
        "tile_sample_min_height": 32,
        "tile_sample_min_width": 32,
        "tile_sample_stride_height": 24,
        "tile_sample_stride_width": 16,
    }
    ref.enable_tiling(**tiles)
    ours.enable_tiling(**tiles)
    try:
        with torch.no_grad():
            want = ref.decode(z).sample
            got = ours.decode(z)
    finally:
        ref.disable_tiling()
        ours.disable_tiling()
    assert got.shape == want.shape
    assert_parity(got, want, "mochi vae tiled decode", min_db=MIN_DB)
