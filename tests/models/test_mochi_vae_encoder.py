"""Native Mochi VAE encoder against Diffusers' `AutoencoderKLMochi.encode` on the same tiny random weights
(fp32, CPU): the posterior's mean and log-variance at 1, 7 and 13 frames (1 + 6k) and at 8 (not 1 + 6k, odd
sizes: Diffusers floors), non-square frames, a batch of two with slicing, the attention in groups of pixels,
a non-default `add_attention_block` and other `temporal_expansions` / `spatial_expansions`, tiled encode with
small tiles, a control input, and an encode -> decode round trip's shape."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.vaes import autoencoder_kl_mochi as mochi
from diffserve.models.vaes.autoencoder_kl_mochi import AutoencoderKLMochi
from diffserve.testing.parity import assert_parity, parity_pair, snr_db
from diffserve.testing.vae_parity import weight_noise

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0

#: The released kinds of level (6x temporal: 1, 2, 3; 8x spatial) at a tiny width, two heads (64 channels)
#: in the lower levels, and attention in the first block too (the released layout has none there).
TINY: dict[str, Any] = {
    "encoder_block_out_channels": (32, 32, 64, 64),
    "decoder_block_out_channels": (32, 32, 32, 64),
    "latent_channels": 4,
    "layers_per_block": (1, 1, 1, 1, 1),
    "add_attention_block": (True, False, True, True, True),
    "latents_mean": (0.1, -0.2, 0.05, 0.0),
    "latents_std": (0.9, 1.1, 1.3, 0.8),
}
#: Other expansions: 4x temporal (2, 1, 2), 4x spatial (1, 2, 2), two levels.
OTHER_EXPANSIONS: dict[str, Any] = {
    **TINY,
    "temporal_expansions": (2, 1, 2),
    "spatial_expansions": (1, 2, 2),
}


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLMochi]:
    return parity_pair(diffusers.AutoencoderKLMochi, AutoencoderKLMochi, TINY, perturb=weight_noise(0.02))


def _video(batch: int, frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """A random video in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, height, width, generator=generator) * 2 - 1


def _assert_posteriors_match(ref: torch.nn.Module, ours: AutoencoderKLMochi, x: torch.Tensor, what: str):
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert_parity(got.mean, want.mean, f"{what} mean", min_db=MIN_DB)
    assert_parity(got.logvar, want.logvar, f"{what} logvar", min_db=MIN_DB)
    return got


@pytest.mark.parametrize(
    ("frames", "height", "width", "latent_shape"),
    [
        (1, 16, 24, (1, 2, 3)),  # one frame: the attention's single-frame path
        (7, 16, 24, (2, 2, 3)),
        (13, 24, 16, (3, 3, 2)),
        (8, 17, 23, (2, 2, 2)),  # not 1 + 6k, sizes not multiples of 8: floored
    ],
)
def test_encode_matches(pair, frames: int, height: int, width: int, latent_shape: tuple[int, ...]) -> None:
    ref, ours = pair
    x = _video(1, frames, height, width, seed=frames)
    got = _assert_posteriors_match(ref, ours, x, f"mochi vae encode {frames}x{height}x{width}")
    assert tuple(got.mean.shape) == (1, 4, *latent_shape)


def test_sliced_batch_matches(pair) -> None:
    ref, ours = pair
    x = _video(2, 7, 16, 24, seed=3)
    ours.enable_slicing()
    try:
        _assert_posteriors_match(ref, ours, x, "mochi vae sliced encode of two clips")
    finally:
        ours.disable_slicing()


def test_attention_in_groups_of_pixels_matches(pair, monkeypatch) -> None:
    """The attention's bound on pixels per call (2^15: never reached here) cut small: the same posterior."""
    ref, ours = pair
    monkeypatch.setattr(mochi, "ATTENTION_POSITIONS_PER_CALL", 5)
    _assert_posteriors_match(ref, ours, _video(1, 7, 16, 24, seed=4), "mochi vae encode, attention in groups")


def test_other_expansions_match() -> None:
    ref, ours = parity_pair(
        diffusers.AutoencoderKLMochi, AutoencoderKLMochi, OTHER_EXPANSIONS, perturb=weight_noise(0.02)
    )
    assert ours.temporal_compression_ratio == 4 and ours.spatial_compression_ratio == 4
    x = _video(1, 9, 12, 8, seed=9)
    got = _assert_posteriors_match(ref, ours, x, "mochi vae encode, 4x / 4x expansions")
    assert tuple(got.mean.shape) == (1, 4, 3, 3, 2)


def test_tiled_encode_matches(pair) -> None:
    ref, ours = pair
    x = _video(1, 7, 32, 40, seed=11)
    with torch.no_grad():
        whole = ours.encode(x).mean
    tiles = {
        "tile_sample_min_height": 24,
        "tile_sample_min_width": 32,
        "tile_sample_stride_height": 16,
        "tile_sample_stride_width": 16,
    }
    ref.enable_tiling(**tiles)
    ours.enable_tiling(**tiles)
    try:
        got = _assert_posteriors_match(ref, ours, x, "mochi vae tiled encode")
    finally:
        ref.disable_tiling()
        ours.disable_tiling()
    assert tuple(got.mean.shape) == (1, 4, 2, 4, 5)
    assert snr_db(got.mean, whole) < 60, "tiling left the latents unchanged: were the tiles used?"


def test_other_input_gives_other_latents(pair) -> None:
    _, ours = pair
    with torch.no_grad():
        a = ours.encode(_video(1, 7, 16, 24, seed=1)).mean
        b = ours.encode(_video(1, 7, 16, 24, seed=2)).mean
    assert snr_db(a, b) < 10


def test_encode_decode_round_trip_shape(pair) -> None:
    _, ours = pair
    x = _video(1, 13, 16, 24, seed=5)
    with torch.no_grad():
        posterior = ours.encode(x)
        video = ours.decode(posterior.mode())
        sampled = posterior.sample(torch.Generator().manual_seed(0))
    assert video.shape == x.shape
    assert sampled.shape == posterior.mean.shape and not torch.equal(sampled, posterior.mean)


def test_rejects_other_channel_counts(pair) -> None:
    _, ours = pair
    with pytest.raises(ValueError, match="expected a video batch"):
        ours.encode(torch.zeros(1, 4, 7, 16, 16))
