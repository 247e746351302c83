"""Native Wan 2.1 VAE against Diffusers' `AutoencoderKLWan` (Wan 2.1 layout) on the same tiny random weights."""

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

#: Wan 2.1's layout (three downsamplings, the last two temporal) at a tiny width.
WAN21_TINY: dict[str, Any] = {
    "base_dim": 16,
    "z_dim": 4,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.1, -0.2, 0.3, -0.4],
    "latents_std": [1.5, 2.0, 0.5, 1.0],
}
#: Same, with a decoder narrower than the encoder (a key Wan's config has and Qwen-Image's lacks).
WAN21_NARROW_DECODER: dict[str, Any] = {**WAN21_TINY, "decoder_base_dim": 8}

CONFIGS = {"wan2.1": WAN21_TINY, "narrow-decoder": WAN21_NARROW_DECODER}


def _perturb(model: torch.nn.Module) -> None:
    """Diffusers starts the RMS-norm gains at one; move every tensor so a misrouted weight shows."""
    perturb_parameters(model, 0.02, gain_suffix="gamma")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, AutoencoderKLWan]:
    return parity_pair(diffusers.AutoencoderKLWan, AutoencoderKLWan, CONFIGS[request.param], perturb=_perturb)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_parity(got, want, f"wan vae parity {label}", max_abs=MAX_ABS, min_cos=MIN_COS)


def test_state_dict_keys_and_shapes_match_diffusers(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    ref, ours = pair
    assert_same_state_dict_layout(ours, ref)


def test_video_encode_and_decode(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    """A 5-frame clip, batch 2, non-square: posterior (mean, logvar, seeded sample) and the decoded video."""
    ref, ours = pair
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 5, 16, 24, generator=g) * 2 - 1
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert got.mean.shape == (2, 4, 2, 2, 3)
    _compare("encode T=5 mean", got.mean, want.mean)
    _compare("encode T=5 logvar", got.logvar, want.logvar)
    _compare(
        "encode T=5 sample",
        got.sample(torch.Generator().manual_seed(7)),
        want.sample(torch.Generator().manual_seed(7)),
    )

    z = torch.randn(2, 4, 2, 2, 3, generator=g)
    with torch.no_grad():
        want_video = ref.decode(z).sample
        got_video = ours.decode(z)
    assert got_video.shape == (2, 3, 5, 16, 24)
    _compare("decode t=2", got_video, want_video)


def test_decode_single_frame(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    ref, ours = pair
    z = torch.randn(1, 4, 1, 3, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _compare("decode t=1 3x2", ours.decode(z), ref.decode(z).sample)


def test_config_and_helpers(pair: tuple[torch.nn.Module, AutoencoderKLWan]) -> None:
    ref, ours = pair
    assert AutoencoderKLWan.diffusers_class_name == "AutoencoderKLWan"
    assert ours.latents_mean == list(ref.config.latents_mean)
    assert ours.latents_std == list(ref.config.latents_std)
    assert ours.spatial_compression_ratio == ref.config.scale_factor_spatial == 8
    assert ours.temporal_compression_ratio == ref.config.scale_factor_temporal == 4


def test_bad_patch_size_is_rejected() -> None:
    """The Wan 2.2 layout (`is_residual`, `patch_size`) is tested in test_wan22_vae_parity.py."""
    with pytest.raises(ValueError, match="patch_size"):
        AutoencoderKLWan.from_config({**WAN21_TINY, "patch_size": 0})


def test_from_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="AutoencoderKLWan config has unknown keys"):
        AutoencoderKLWan.from_config({**WAN21_TINY, "input_channels": 3})
