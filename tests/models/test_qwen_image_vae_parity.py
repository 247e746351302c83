"""Native Qwen-Image causal 3-D VAE against Diffusers' `AutoencoderKLQwenImage` on the same tiny random weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_vaes import WAN21_TINY, perturb_gains

from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.autoencoder_kl_qwen_image import AutoencoderKLQwenImage
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    native_from_reference,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")

MAX_ABS = 1e-5
MIN_COS = 0.9999

#: All three downsampling levels of the released model (the last two temporal), at a tiny width.
TINY: dict[str, Any] = WAN21_TINY


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLQwenImage]:
    return parity_pair(diffusers.AutoencoderKLQwenImage, AutoencoderKLQwenImage, TINY, perturb=perturb_gains)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor, max_abs: float = MAX_ABS) -> None:
    assert_parity(got, want, f"qwen-image vae parity {label}", max_abs=max_abs, min_cos=MIN_COS)


def _video(batch: int, frames: int, height: int, width: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, height, width, generator=g) * 2 - 1


def _latents(batch: int, frames: int, height: int, width: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, TINY["z_dim"], frames, height, width, generator=g)


@pytest.mark.parametrize("attn_scales", [[], [1.0, 0.5]], ids=["released", "encoder-attention"])
def test_state_dict_keys_and_shapes_match_diffusers(attn_scales: list[float]) -> None:
    config = {**TINY, "attn_scales": attn_scales}
    ref = diffusers.AutoencoderKLQwenImage(**config)
    with torch.device("meta"):
        ours = AutoencoderKLQwenImage(**config)
    assert_same_state_dict_layout(ours, ref)


def test_decode_single_frame_non_square(pair: tuple[torch.nn.Module, AutoencoderKLQwenImage]) -> None:
    """Qwen-Image's use: one latent frame -> one image, here 24x40 pixels from 3x5 latents, batch 2."""
    ref, ours = pair
    z = _latents(2, 1, 3, 5)
    with torch.no_grad():
        want = ref.decode(z).sample
        got = ours.decode(z)
    assert got.shape == (2, 3, 1, 24, 40)
    assert got.abs().max() <= 1.0
    _compare("decode T=1 3x5", got, want)


def test_encode_single_frame(pair: tuple[torch.nn.Module, AutoencoderKLQwenImage]) -> None:
    """Image -> posterior: mean, log-variance, mode() and seeded sample() as Diffusers' distribution gives them."""
    ref, ours = pair
    x = _video(2, 1, 16, 32)
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert isinstance(got, DiagonalGaussian)
    assert got.mean.shape == (2, TINY["z_dim"], 1, 2, 4)
    _compare("encode T=1 mean", got.mean, want.mean)
    _compare("encode T=1 logvar", got.logvar, want.logvar)
    _compare("encode T=1 mode", got.mode(), want.mode())
    _compare(
        "encode T=1 sample",
        got.sample(torch.Generator().manual_seed(7)),
        want.sample(torch.Generator().manual_seed(7)),
    )
    per_row = [torch.Generator().manual_seed(s) for s in (3, 4)]
    per_row_ref = [torch.Generator().manual_seed(s) for s in (3, 4)]
    _compare("encode T=1 sample per-row generators", got.sample(per_row), want.sample(per_row_ref))


@pytest.mark.parametrize("frames", [5, 9])
def test_video_encode_and_decode(pair: tuple[torch.nn.Module, AutoencoderKLQwenImage], frames: int) -> None:
    """Wan's use: 1 + 4k frames, encoded as frame 0 then chunks of 4, decoded frame by frame through the cache."""
    ref, ours = pair
    x = _video(2, frames, 16, 24)
    latent_frames = 1 + (frames - 1) // 4
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert got.mean.shape == (2, TINY["z_dim"], latent_frames, 2, 3)
    _compare(f"encode T={frames} mean", got.mean, want.mean)
    _compare(f"encode T={frames} logvar", got.logvar, want.logvar)

    z = _latents(2, latent_frames, 2, 3)
    with torch.no_grad():
        want_video = ref.decode(z).sample
        got_video = ours.decode(z)
    assert got_video.shape == (2, 3, frames, 16, 24)
    _compare(f"decode t={latent_frames}", got_video, want_video)


def test_video_frames_past_the_last_chunk_are_ignored(
    pair: tuple[torch.nn.Module, AutoencoderKLQwenImage],
) -> None:
    """As in Diffusers: 7 frames encode like their first 5 (one full chunk after frame 0)."""
    ref, ours = pair
    x = _video(1, 7, 16, 16)
    with torch.no_grad():
        got = ours.encode(x).mean
        want = ref.encode(x).latent_dist.mean
        first_five = ours.encode(x[:, :, :5]).mean
    _compare("encode T=7", got, want)
    torch.testing.assert_close(got, first_five, rtol=0, atol=0)


def test_batch_rows_are_independent(pair: tuple[torch.nn.Module, AutoencoderKLQwenImage]) -> None:
    _, ours = pair
    z = _latents(2, 2, 2, 3)
    with torch.no_grad():
        batched = ours.decode(z)
        for i in range(2):
            torch.testing.assert_close(ours.decode(z[i : i + 1]), batched[i : i + 1], rtol=1e-5, atol=1e-5)


def test_parity_bf16(pair: tuple[torch.nn.Module, AutoencoderKLQwenImage]) -> None:
    """Half precision follows Diffusers' rounding: same op order, layouts and fp32 norm/upsample."""
    ref, _ = pair
    ref16 = diffusers.AutoencoderKLQwenImage(**TINY).eval()
    ref16.load_state_dict(ref.state_dict())
    ref16 = ref16.to(torch.bfloat16)
    ours = native_from_reference(AutoencoderKLQwenImage, ref16)
    z = _latents(1, 2, 2, 3).to(torch.bfloat16)
    x = _video(1, 5, 16, 24).to(torch.bfloat16)
    with torch.no_grad():
        _compare("bf16 decode t=2", ours.decode(z), ref16.decode(z).sample, max_abs=2e-2)
        _compare("bf16 encode T=5", ours.encode(x).mean, ref16.encode(x).latent_dist.mean, max_abs=2e-2)


def test_config_and_helpers(pair: tuple[torch.nn.Module, AutoencoderKLQwenImage]) -> None:
    _, ours = pair
    assert AutoencoderKLQwenImage.diffusers_class_name == "AutoencoderKLQwenImage"
    assert ours.latents_mean == TINY["latents_mean"]
    assert ours.latents_std == TINY["latents_std"]
    assert ours.config["z_dim"] == TINY["z_dim"]
    assert ours.spatial_compression_ratio == 8
    assert ours.temporal_compression_ratio == 4


def test_from_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="AutoencoderKLQwenImage config has unknown keys"):
        AutoencoderKLQwenImage.from_config({**TINY, "is_residual": False})


def test_temporal_downsample_must_match_levels() -> None:
    with pytest.raises(ValueError, match="temperal_downsample"):
        AutoencoderKLQwenImage(**{**TINY, "temperal_downsample": [True, True]})
