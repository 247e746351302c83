"""Native Wan 2.2 VAE (TI2V-5B layout: `is_residual`, `patch_size` 2, z_dim 48) against Diffusers'
`AutoencoderKLWan` on the same tiny random weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    parity_pair,
    perturb_parameters,
)

diffusers = pytest.importorskip("diffusers")

MAX_ABS = 1e-5
MIN_COS = 0.9999
Z_DIM = 48

#: Wan 2.2's layout (residual levels, 2x2 patches into 12 channels, 16x spatial compression) at a tiny
#: width, with a decoder wider than the encoder as the released one (160 / 256).
WAN22_TINY: dict[str, Any] = {
    "base_dim": 8,
    "decoder_base_dim": 12,
    "z_dim": Z_DIM,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "latents_mean": [0.01 * i - 0.2 for i in range(Z_DIM)],
    "latents_std": [0.5 + 0.03 * i for i in range(Z_DIM)],
}


def _perturb(model: torch.nn.Module) -> None:
    """Diffusers starts the RMS-norm gains at one; move every tensor so a misrouted weight shows."""
    perturb_parameters(model, 0.02, gain_suffix="gamma")


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLWan]:
    return parity_pair(diffusers.AutoencoderKLWan, AutoencoderKLWan, WAN22_TINY, perturb=_perturb)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_parity(got, want, f"wan2.2 vae parity {label}", max_abs=MAX_ABS, min_cos=MIN_COS)


def test_state_dict_keys_and_shapes_match_diffusers(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    ref, ours = pair
    assert_same_state_dict_layout(ours, ref)


def test_video_encode_and_decode(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    """A 5-frame clip, batch 2, non-square 32x48: posterior (mean, logvar) and the decoded video."""
    ref, ours = pair
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 5, 32, 48, generator=g) * 2 - 1
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert got.mean.shape == (2, Z_DIM, 2, 2, 3)
    _compare("encode T=5 mean", got.mean, want.mean)
    _compare("encode T=5 logvar", got.logvar, want.logvar)

    z = torch.randn(2, Z_DIM, 2, 2, 3, generator=g)
    with torch.no_grad():
        want_video = ref.decode(z).sample
        got_video = ours.decode(z)
    assert got_video.shape == (2, 3, 5, 32, 48)
    _compare("decode t=2", got_video, want_video)


def test_image_encode_and_three_latent_frames_decode(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    """A single frame (the I2V conditioning image) and a 3-latent-frame decode (two later chunks)."""
    ref, ours = pair
    g = torch.Generator().manual_seed(2)
    x = torch.rand(1, 3, 1, 48, 32, generator=g) * 2 - 1
    with torch.no_grad():
        _compare("encode T=1 mean", ours.encode(x).mean, ref.encode(x).latent_dist.mean)
    z = torch.randn(1, Z_DIM, 3, 3, 2, generator=g)
    with torch.no_grad():
        _compare("decode t=3", ours.decode(z), ref.decode(z).sample)


def test_config_and_helpers(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    ref, ours = pair
    assert ours.latents_mean == list(ref.config.latents_mean)
    assert ours.latents_std == list(ref.config.latents_std)
    assert ours.spatial_compression_ratio == ref.config.scale_factor_spatial == 16
    assert ours.temporal_compression_ratio == ref.config.scale_factor_temporal == 4
    assert ours.config["z_dim"] == Z_DIM
