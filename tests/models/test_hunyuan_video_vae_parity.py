"""Native HunyuanVideo VAE against Diffusers' `AutoencoderKLHunyuanVideo` on the same tiny random weights:
decode at several latent frame counts (past 4 latent frames Diffusers' default framewise decoding cuts the
clip into overlapping chunks), a batch of two, tiled decode with small tiles, encode (one chunk and
framewise), and the released layout's state-dict keys on the meta device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_hunyuan_video import (
    HUNYUAN_VIDEO_VAE_CONFIG_DEFAULTS,
    AutoencoderKLHunyuanVideo,
)
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair
from diffserve.testing.vae_parity import assert_config_defaults_are_diffusers, tiled_decodes, weight_noise

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0
TINY: dict[str, Any] = {
    "latent_channels": 4,
    "block_out_channels": (8, 16, 16, 16),
    "layers_per_block": 1,
    "norm_num_groups": 4,
}


@pytest.fixture(scope="module")
def pair():
    return parity_pair(
        diffusers.AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo, TINY, perturb=weight_noise(0.05)
    )


def test_config_defaults_are_diffusers() -> None:
    assert_config_defaults_are_diffusers(
        diffusers.AutoencoderKLHunyuanVideo, HUNYUAN_VIDEO_VAE_CONFIG_DEFAULTS
    )


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLHunyuanVideo()
        ours = AutoencoderKLHunyuanVideo.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)
    assert ours.spatial_compression_ratio == 8 and ours.temporal_compression_ratio == 4


@pytest.mark.parametrize(("batch", "frames"), [(1, 1), (2, 2), (1, 7)])
def test_decode_matches(pair, batch: int, frames: int) -> None:
    ref, ours = pair
    assert_same_state_dict_layout(ours, ref)
    z = torch.randn(batch, 4, frames, 3, 5, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want = ref.decode(z).sample
        got = ours.decode(z)
    assert got.shape == want.shape == (batch, 3, 1 + 4 * (frames - 1), 24, 40)
    db = assert_parity(got, want, f"hunyuan video vae decode {batch} x {frames}", min_db=MIN_DB)
    print(f"hunyuan video vae decode {batch} x {frames}: {db}")


def test_tiled_decode_matches(pair) -> None:
    ref, ours = pair
    z = torch.randn(1, 4, 6, 5, 7, generator=torch.Generator().manual_seed(7))
    tiles = {
        "tile_sample_min_height": 32,
        "tile_sample_min_width": 32,
        "tile_sample_stride_height": 24,
        "tile_sample_stride_width": 16,
    }
    got, want = tiled_decodes(ref, ours, z, tiles)
    assert got.shape == want.shape
    db = assert_parity(got, want, "hunyuan video vae tiled decode", min_db=MIN_DB)
    print(f"hunyuan video vae tiled decode: {db}")


@pytest.mark.parametrize("frames", [5, 21])
def test_encode_matches(pair, frames: int) -> None:
    ref, ours = pair
    x = torch.rand(1, 3, frames, 16, 24, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert got.mean.shape == want.mean.shape
    db = assert_parity(got.mean, want.mean, f"hunyuan video vae encode {frames} frames", min_db=MIN_DB)
    assert_parity(got.logvar, want.logvar, f"hunyuan video vae encode logvar {frames}", min_db=MIN_DB)
    print(f"hunyuan video vae encode {frames}: {db}")
