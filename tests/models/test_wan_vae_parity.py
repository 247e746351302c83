"""Native Wan VAE against Diffusers' `AutoencoderKLWan` on the same tiny random weights: Wan 2.1's layout
(and with a decoder narrower than the encoder) and Wan 2.2's (TI2V-5B: `is_residual`, `patch_size` 2,
z_dim 48, 16x spatial compression)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from tiny_vaes import WAN21_TINY, perturb_gains, wan22_tiny

from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")

MAX_ABS = 1e-5
MIN_COS = 0.9999
WAN22_Z_DIM = 48

CONFIGS: dict[str, dict[str, Any]] = {
    "wan2.1": WAN21_TINY,
    # A decoder narrower than the encoder (a key Wan's config has and Qwen-Image's lacks).
    "narrow-decoder": {**WAN21_TINY, "decoder_base_dim": 8},
    "wan2.2": wan22_tiny(
        WAN22_Z_DIM,
        latents_mean=[0.01 * i - 0.2 for i in range(WAN22_Z_DIM)],
        latents_std=[0.5 + 0.03 * i for i in range(WAN22_Z_DIM)],
    ),
}
#: Spatial compression by layout.
COMPRESSION = {"wan2.1": 8, "narrow-decoder": 8, "wan2.2": 16}
WAN21_CONFIGS = ["narrow-decoder", "wan2.1"]


@functools.cache
def _pair(name: str) -> tuple[torch.nn.Module, AutoencoderKLWan]:
    return parity_pair(diffusers.AutoencoderKLWan, AutoencoderKLWan, CONFIGS[name], perturb=perturb_gains)


def _compare(name: str, label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_parity(got, want, f"{name} vae parity {label}", max_abs=MAX_ABS, min_cos=MIN_COS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_keys_and_shapes_match_diffusers(name: str) -> None:
    ref, ours = _pair(name)
    assert_same_state_dict_layout(ours, ref)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_video_encode_and_decode(name: str) -> None:
    """A 5-frame clip, batch 2, non-square (2 x 3 latents): posterior (mean, logvar, seeded sample) and the
    decoded video."""
    ref, ours = _pair(name)
    z_dim, f = CONFIGS[name]["z_dim"], COMPRESSION[name]
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 5, 2 * f, 3 * f, generator=g) * 2 - 1
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert got.mean.shape == (2, z_dim, 2, 2, 3)
    _compare(name, "encode T=5 mean", got.mean, want.mean)
    _compare(name, "encode T=5 logvar", got.logvar, want.logvar)
    _compare(
        name,
        "encode T=5 sample",
        got.sample(torch.Generator().manual_seed(7)),
        want.sample(torch.Generator().manual_seed(7)),
    )

    z = torch.randn(2, z_dim, 2, 2, 3, generator=g)
    with torch.no_grad():
        want_video = ref.decode(z).sample
        got_video = ours.decode(z)
    assert got_video.shape == (2, 3, 5, 2 * f, 3 * f)
    _compare(name, "decode t=2", got_video, want_video)


@pytest.mark.parametrize("name", WAN21_CONFIGS)
def test_decode_single_frame(name: str) -> None:
    ref, ours = _pair(name)
    z = torch.randn(1, 4, 1, 3, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _compare(name, "decode t=1 3x2", ours.decode(z), ref.decode(z).sample)


def test_wan22_image_encode_and_three_latent_frames_decode() -> None:
    """A single frame (the I2V conditioning image) and a 3-latent-frame decode (two later chunks)."""
    ref, ours = _pair("wan2.2")
    g = torch.Generator().manual_seed(2)
    x = torch.rand(1, 3, 1, 48, 32, generator=g) * 2 - 1
    with torch.no_grad():
        _compare("wan2.2", "encode T=1 mean", ours.encode(x).mean, ref.encode(x).latent_dist.mean)
    z = torch.randn(1, WAN22_Z_DIM, 3, 3, 2, generator=g)
    with torch.no_grad():
        _compare("wan2.2", "decode t=3", ours.decode(z), ref.decode(z).sample)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_and_helpers(name: str) -> None:
    ref, ours = _pair(name)
    assert AutoencoderKLWan.diffusers_class_name == "AutoencoderKLWan"
    assert ours.latents_mean == list(ref.config.latents_mean)
    assert ours.latents_std == list(ref.config.latents_std)
    assert ours.spatial_compression_ratio == ref.config.scale_factor_spatial == COMPRESSION[name]
    assert ours.temporal_compression_ratio == ref.config.scale_factor_temporal == 4
    assert ours.config["z_dim"] == CONFIGS[name]["z_dim"]


def test_bad_patch_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="patch_size"):
        AutoencoderKLWan.from_config({**WAN21_TINY, "patch_size": 0})


def test_from_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="AutoencoderKLWan config has unknown keys"):
        AutoencoderKLWan.from_config({**WAN21_TINY, "input_channels": 3})
