"""Streaming a long diffusion-forcing video window by window: a streamed job's finished windows are decoded
while its later windows are still being denoised, and the final decode only decodes what is left.

Diffusers' `SkyReelsV2DiffusionForcingPipeline` decodes a long video once, after its last window: the
windows' latents are joined (each later window without its overlap frames, which the video already has)
and the whole latent video goes through the VAE. A window's appended latent frames never change after it
finishes (the next windows only read them as their prefix), and the Wan VAE decodes causally, one latent
frame at a time with a cache of the previous frames' activations (`CausalVideoVAE.decode_frames`): a
latent frame's pixels depend on it and the frames before it only. So decoding the finished frames early,
in order, with one cache kept for the whole clip, gives the final decode's pixels; the final decode
continues that cache over the frames left and joins the pixels already made, so the file is the streamed
chunks followed by the rest.

Video-to-video (Diffusers' `SkyReelsV2DiffusionForcingVideoToVideoPipeline`, `skyreels_v2_v2v.py`) outputs
the input video's frames, resized to the output size, followed by the decoded latents (the re-encoded
overlap first). Those leading frames (`SkyReelsV2ForcingConditioning.leading_pixels`) are output pixels from
the start: a streamed request publishes them as its first chunk as soon as they are resized, before its
first step (else, where the request was prepared on another engine, just before its first decoded frame),
then its windows' frames as they are decoded; the final decode joins the same leading frames to the
decoded ones, streamed or not.

Only a streamed request (`Req.on_decoded`) of one video on one rank, with the VAE's tiling off, is decoded
early: a tiled decode blends overlapping spatial tiles of the whole clip, a batch of videos cannot be
streamed (the engine streams one video), and with several ranks the decode is split by rows over them.
Every other request is decoded whole after its last window, exactly as before.

A request decodes at most one latent frame (one VAE chunk, the unit the engine interleaves decodes by) per
denoising step of its own, after its step, so a finished window's decode is spread over the next window's
steps and never holds a batch up for a whole window; frames still pending when the last window ends are
left to the final decode, which the engine interleaves with other requests' steps as usual. A decode
between steps that fails ends the request's early decoding only (logged): its final decode then decodes the
whole clip, and the job writes the frames it had not streamed yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from diffserve.distributed.state import current_parallel_state
from diffserve.families.wan.skyreels_v2_forcing_state import (
    SkyReelsV2ForcingConditioning,
    WindowDecode,
)
from diffserve.models.vaes.causal3d_blocks import CausalCache, CausalVideoVAE
from diffserve.request import Req
from diffserve.stages.base import to_module
from diffserve.stages.video_vae_decoding import (
    VideoVaeDecodingStage,
    denormalize_latents,
    video_to_uint8,
)
from diffserve.vae_tiling import decode_chunk_output, decode_output_scope

logger = logging.getLogger(__name__)

#: Called with one decoded latent frame's pixels, (1, C, frames, H, W) clamped to [-1, 1].
PixelSink = Callable[[torch.Tensor], None]


def streams_output(req: Req) -> bool:
    """Whether `req` hands its output's frames out as they are made (`Req.on_decoded`): a streamed request
    of one video, on one rank (split over ranks, a rank decodes a band of rows, not the frames)."""
    if req.on_decoded is None or req.batch_size != 1:
        return False
    state = current_parallel_state()
    return state is None or state.world_size == 1


def streams_windows(vae: nn.Module, req: Req) -> bool:
    """Whether `req`'s finished windows are decoded while it denoises (see the module docstring): a
    streamed request of one video, on one rank, through an untiled causal video VAE."""
    return streams_output(req) and isinstance(vae, CausalVideoVAE) and not vae.use_tiling


def publish_leading(req: Req, publish: PixelSink) -> None:
    """Hand the request's leading frames (`SkyReelsV2ForcingConditioning.leading_pixels`: video-to-video's
    resized input video) to `publish`, once: the first chunk of its output, before any decoded frame."""
    conditioning = SkyReelsV2ForcingConditioning.of(req)
    if conditioning.leading_pixels is None or conditioning.leading_published:
        return
    conditioning.leading_published = True
    publish(conditioning.leading_pixels)


def with_leading(req: Req, videos: list[np.ndarray]) -> list[np.ndarray]:
    """Each decoded video (uint8 frames) after the request's leading frames, if it has any (Diffusers joins
    them in [-1, 1] before converting; the conversion is per element, so converting each part alone is
    the same)."""
    pixels = SkyReelsV2ForcingConditioning.of(req).leading_pixels
    if pixels is None:
        return videos
    leading = video_to_uint8(pixels)[0]
    return [np.concatenate([leading, frames]) for frames in videos]


def decode_frames(vae: CausalVideoVAE, req: Req, limit: int | None, publish: PixelSink) -> int:
    """Decode up to `limit` (None: all) of the request's finished latent frames not decoded yet, in order,
    continuing its clip's causal cache (`CausalVideoVAE.decode_frames`, the loop of the VAE's own
    whole-clip decode); each frame's pixels are handed to `publish` (after the request's leading frames,
    if not handed out yet: `publish_leading`) and kept as the output's uint8 frames
    (`WindowDecode.pixels`). Returns how many were decoded."""
    progress = SkyReelsV2ForcingConditioning.of(req).progress
    assert progress is not None, "diffusion-forcing timestep preparation has not run"
    video = progress.video
    if video is None:
        return 0
    if progress.decoded is None:
        progress.decoded = WindowDecode(cache=CausalCache())
    done = progress.decoded
    if done.failed:
        return 0
    start = done.frames
    stop = video.shape[2] if limit is None else min(video.shape[2], start + limit)
    if stop <= start:
        return 0
    assert isinstance(done.cache, CausalCache)
    publish_leading(req, publish)

    def keep(pixels: torch.Tensor) -> None:
        done.pixels.append(video_to_uint8(pixels)[0])
        done.frames += 1
        publish(pixels)

    with torch.inference_mode():
        latents = denormalize_latents(vae, to_module(vae, video[:, :, start:stop]))
        vae.decode_frames(latents, done.cache, keep)
    return done.frames - start


class ForcingWindowDecoder:
    """Decodes a streamed request's finished windows between its denoising steps (the denoiser calls
    `after_step` for every request it stepped) and hands each frame to the job (`Req.on_decoded`)."""

    def __init__(self, vae: nn.Module, frames_per_step: int = 1) -> None:
        if frames_per_step < 1:
            raise ValueError(
                f"SkyReels-V2 diffusion forcing: frames_per_step must be >= 1, not {frames_per_step}"
            )
        self.vae = vae
        self.frames_per_step = frames_per_step

    def after_step(self, req: Req) -> int:
        """After one of `req`'s steps: decode and publish up to `frames_per_step` of its finished latent
        frames, unless it has no more steps (the final decode takes what is left) or is not streamed.
        Returns how many were decoded."""
        if req.step_index >= req.num_steps or not streams_windows(self.vae, req):
            return 0
        assert isinstance(self.vae, CausalVideoVAE) and req.on_decoded is not None
        try:
            return decode_frames(self.vae, req, self.frames_per_step, req.on_decoded)
        except Exception:  # this request's streaming only: the batch's step and the request go on
            logger.exception(
                "Request %s: decoding a finished window failed; its other frames stream after its last "
                "window",
                req.request_id,
            )
            progress = SkyReelsV2ForcingConditioning.of(req).progress
            if progress is not None and progress.decoded is not None:
                progress.decoded.failed = True
            return 0


class SkyReelsV2ForcingDecodingStage(VideoVaeDecodingStage):
    """Wan's video decode, except for a request whose finished windows were decoded while it denoised
    (`ForcingWindowDecoder`): its frames left are decoded with the same causal cache, a chunk at a time as
    the VAE's own decode goes (`decode_chunk_boundary` before each, its pixels handed out with
    `decode_chunk_output`), and joined to the pixels already made. Such a request's decode stays untiled
    even if the engine asked for a tiled one, so that the file is exactly the chunks streamed before. The
    request's leading frames (video-to-video's input video, `with_leading`) come first in its output, and
    are handed out before its first decoded chunk if they were not yet."""

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        progress = SkyReelsV2ForcingConditioning.of(req).progress
        if progress is None or progress.decoded is None:
            publish_leading(req, decode_chunk_output)  # to the job, if it streams the decode's chunks
            super().forward(req)
        elif progress.decoded.failed:  # the whole clip, as unstreamed; the job writes the frames not streamed
            progress.decoded = None
            with decode_output_scope(None):
                super().forward(req)
        else:
            assert isinstance(self.vae, CausalVideoVAE)
            assert progress.video is not None and progress.video.shape == req.latents.shape
            decode_frames(self.vae, req, None, decode_chunk_output)
            req.outputs.frames = [np.concatenate(progress.decoded.pixels)]
            progress.decoded = None  # the cache and pixels are no longer needed
        assert req.outputs.frames is not None
        req.outputs.frames = with_leading(req, req.outputs.frames)
        return req
