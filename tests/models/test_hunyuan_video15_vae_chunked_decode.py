"""HunyuanVideo-1.5's frame-chunked VAE decode (`AutoencoderKLHunyuanVideo15._decode_frames`): the decoder
run a few latent frames at a time with a causal cache gives the frames of the one-pass decode
(`decode_whole_clip`, Diffusers' way) and matches Diffusers' `AutoencoderKLHunyuanVideo15.decode` on the same
tiny random weights, for 1, 5, 9 and 17 frames, square and not, in chunks of 1 and 2 latent frames.

Not bit for bit: the same maths, but torch's CPU conv3d rounds an output frame differently when it computes
fewer frames at once (a GEMM of another size; measured 2e-7 on one conv), so the bars are fp32 rounding:
PSNR (peak = the reference's range) >= 100 dB and a max abs difference of at most 1e-5.

And what a streamed video job sees (`vae_tiling.decode_output_scope`): each chunk's pixels handed out in
order as soon as they are decoded (the first before the last latent frame is decoded), their concatenation
the output; a tiled decode hands out nothing; the decoding stage's chunks convert to exactly its frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

# The parity test's tiny layout and tiles (the released layout at a tiny width; tiles of 3 latents).
from test_hunyuan_video15_vae_parity import TILES, TINY

from diffserve.families.hunyuan_video15.decoding import HunyuanVideo15DecodingStage
from diffserve.models.vaes import autoencoder_kl_hunyuan_video15 as hv15
from diffserve.models.vaes.autoencoder_kl_hunyuan_video15 import AutoencoderKLHunyuanVideo15, latent_chunks
from diffserve.stages.video_vae_decoding import video_to_uint8
from diffserve.testing.parity import assert_parity, parity_pair, perturb_parameters, psnr_range_db
from diffserve.vae_tiling import decode_chunk_scope, decode_output_scope

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0
#: Chunked against one-pass decode (fp32 rounding only).
MIN_CHUNKED_DB, MAX_CHUNKED_ABS = 100.0, 1e-5
#: (latent frames, latent rows, latent columns): 1, 5 and 9 video frames; non-square both ways.
SHAPES = [(1, 2, 3), (2, 3, 2), (3, 2, 3), (5, 2, 2)]


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]:
    def perturb(model: torch.nn.Module) -> None:
        perturb_parameters(model, 0.02, gain_suffix="gamma")

    return parity_pair(
        diffusers.AutoencoderKLHunyuanVideo15, AutoencoderKLHunyuanVideo15, TINY, perturb=perturb
    )


def _same_decode(chunked: torch.Tensor, whole: torch.Tensor, what: str) -> None:
    """The chunked decode against the one-pass one: equal up to fp32 rounding."""
    assert_parity(chunked, whole, what, min_db=MIN_CHUNKED_DB, max_abs=MAX_CHUNKED_ABS, metric=psnr_range_db)


def _latents(frames: int, rows: int, cols: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 4, frames, rows, cols, generator=torch.Generator().manual_seed(seed))


def test_latent_chunks() -> None:
    assert latent_chunks(1, 1) == [slice(0, 1)]
    assert latent_chunks(4, 1) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]
    assert latent_chunks(6, 2) == [slice(0, 1), slice(1, 3), slice(3, 5), slice(5, 6)]
    with pytest.raises(ValueError, match="cannot chunk"):
        latent_chunks(0, 1)


@pytest.mark.parametrize("per_chunk", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chunked_decode_is_the_one_pass_decode_and_diffusers(
    pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15],
    shape: tuple[int, int, int],
    per_chunk: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref, ours = pair
    monkeypatch.setattr(hv15, "DECODE_CHUNK_LATENT_FRAMES", per_chunk)
    frames, rows, cols = shape
    z = _latents(*shape, seed=frames * 10 + rows)
    with torch.no_grad():
        chunked, whole, want = ours.decode(z), ours.decode_whole_clip(z), ref.decode(z).sample
    assert chunked.shape == (1, 3, 1 + 4 * (frames - 1), 16 * rows, 16 * cols)
    _same_decode(chunked, whole, f"hunyuan-video-1.5 vae chunked vs one-pass {shape} by {per_chunk}")
    assert_parity(chunked, want, f"hunyuan-video-1.5 vae chunked decode {shape}", min_db=MIN_DB)


def test_chunked_batch_and_sliced_decode(pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]) -> None:
    """A batch of 2 decodes frame-chunked as one pass does, whole and sliced."""
    _, ours = pair
    z = _latents(3, 2, 3, seed=6, batch=2)
    with torch.no_grad():
        whole = ours.decode_whole_clip(z)
        _same_decode(ours.decode(z), whole, "hunyuan-video-1.5 vae chunked batch 2")
        ours.enable_slicing()
        try:
            _same_decode(ours.decode(z), whole, "hunyuan-video-1.5 vae chunked batch 2 sliced")
        finally:
            ours.disable_slicing()


def test_streamed_chunks_come_in_order_before_the_decode_ends(
    pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15],
) -> None:
    """Each latent frame is a decode chunk: its boundary, its decode, then its pixels handed out, before
    the next one's decode starts; the chunks (clamped) are the output."""
    _, ours = pair
    z = _latents(3, 2, 3, seed=8)
    log: list[tuple[str, Any]] = []
    hook = ours.decoder.conv_in.register_forward_pre_hook(
        lambda _module, args: log.append(("decode", args[0].shape[2]))
    )
    try:
        with (
            torch.no_grad(),
            decode_chunk_scope(lambda: log.append(("boundary", None))),
            decode_output_scope(lambda pixels: log.append(("chunk", pixels))),
        ):
            video = ours.decode(z)
    finally:
        hook.remove()
    chunks = [pixels for kind, pixels in log if kind == "chunk"]
    assert [(kind, p.shape[2] if kind == "chunk" else p) for kind, p in log] == [
        ("boundary", None), ("decode", 1), ("chunk", 1),
        ("boundary", None), ("decode", 1), ("chunk", 4),
        ("boundary", None), ("decode", 1), ("chunk", 4),
    ]  # fmt: skip
    assert all(float(p.abs().max()) <= 1.0 for p in chunks)
    assert torch.equal(torch.cat(chunks, dim=2), video.clamp(-1.0, 1.0))


def test_tiled_and_one_pass_decodes_hand_out_nothing(
    pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15],
) -> None:
    """A tiled decode is Diffusers' (one pass per tile, each tile a decode chunk): its tiles are not
    frames of the clip, so nothing is handed out (the stream gets the frames after the decode)."""
    _, ours = pair
    handed: list[torch.Tensor] = []
    boundaries: list[None] = []
    ours.enable_tiling(**TILES)
    try:
        with (
            torch.no_grad(),
            decode_chunk_scope(lambda: boundaries.append(None)),
            decode_output_scope(handed.append),
        ):
            ours.decode(_latents(2, 3, 4, seed=9))
    finally:
        ours.disable_tiling()
    # 2x2 tiles, each a chunk, and in each one-pass tile decode each up block
    assert handed == [] and len(boundaries) == 4 * (1 + len(ours.decoder.up_blocks))
    with torch.no_grad(), decode_output_scope(handed.append):
        ours.decode_whole_clip(_latents(2, 2, 2, seed=10))
    assert handed == []


def test_decoding_stage_chunks_are_its_frames(
    pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15],
) -> None:
    """What the server's streamed job converts (`video_to_uint8` of each chunk) is exactly the stage's
    video frames, chunk by chunk (1 frame, then 4 per latent frame)."""
    _, ours = pair
    stage = HunyuanVideo15DecodingStage(ours)
    latents = _latents(3, 2, 3, seed=11) * 0.7
    handed: list[np.ndarray] = []
    with torch.inference_mode(), decode_output_scope(lambda pixels: handed.extend(video_to_uint8(pixels))):
        video = stage.decode(latents)
    assert [len(chunk) for chunk in handed] == [1, 4, 4]
    assert np.array_equal(np.concatenate(handed), video_to_uint8(video)[0])
