"""SkyReels-V2 diffusion forcing's video extension (Diffusers' `SkyReelsV2DiffusionForcingVideoToVideoPipeline`).

The input video's frames are resized (Lanczos) to the output size; its last `overlap_history` frames are
VAE-encoded (posterior mode, normalised) and, cut to whole causal blocks, start the first window as a long
video's prefix starts the next ones (never stepped; noised anew at every step with `addnoise_condition`).
`num_frames` counts the frames of the latents generated from there, the re-encoded overlap included: the
windows are those of a text-to-video request of `num_frames` (one unless it exceeds `base_num_frames`).
The output is every input frame (resized, as Diffusers' video processor gives them) followed by the decoded
latents, so the overlap's frames appear twice, as in Diffusers: the input frames are the request's leading
frames (`SkyReelsV2ForcingConditioning.leading_pixels`), which the diffusion-forcing decode puts first.

A streamed job (`Req.on_decoded`) publishes the resized input frames as its first chunk as soon as they are
made, before its first step, then each window's frames while the next windows denoise, as a text-to-video
one does (`skyreels_v2_forcing_decode.py`): the chunks, in order, are the output's frames exactly.

Deliberately unlike Diffusers: its video extension sets `num_videos_per_prompt` to 1 whatever the caller
passes; here `num_outputs_per_prompt` makes that many videos, each window's noise drawn for all of them at
once from the request's generator, so the first video is Diffusers' one video for a one-window request only.

The input video comes as `SamplingParams.input_video`, decoded frames: `DiffGenerator.generate(video=...)`,
`diffserve generate --video PATH` and POST /v1/videos' `video` (a file upload or a data URL) give it. The
server's warm-up, calibration and /health_generate probes send a grey one-frame clip continued from its one
frame (`video_probe`), generating `probe_frames`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.image_to_video_preparation import encode_condition, resized_frame
from diffserve.families.wan.skyreels_v2 import (
    SkyReelsV2DiffusionForcingPipeline,
    SkyReelsV2DiffusionForcingValidationStage,
    skyreels_v2_default_sampling_params,
)
from diffserve.families.wan.skyreels_v2_forcing_decode import publish_leading, streams_output
from diffserve.families.wan.skyreels_v2_forcing_settings import causal_block, skyreels_v2_df_settings
from diffserve.families.wan.skyreels_v2_forcing_state import SkyReelsV2ForcingConditioning
from diffserve.image_inputs import without_alpha
from diffserve.pipelines.base import PipelineContext
from diffserve.request import Req
from diffserve.runtime.contract import VideoProbe
from diffserve.stages.base import Stage

#: Diffusers' V2V default `num_frames` is 120, which its `__call__` rounds down to 4k+1 (117) before running.
DEFAULT_NUM_FRAMES = 117


@dataclass
class SkyReelsV2VideoToVideoConditioning(SkyReelsV2ForcingConditioning):
    """Diffusion forcing's conditioning: `condition_latents` the input video's prefix latents (batch,
    channels, frames, h, w), `leading_pixels` its frames at the output size, which lead the output."""


def video_pixels(frames: list[Image.Image], height: int, width: int) -> torch.Tensor:
    """The input frames resized as Diffusers' video processor resizes them, (1, 3, frames, H, W) in [-1, 1]."""
    return torch.cat([resized_frame(frame, height, width) for frame in frames], dim=2)


def prefix_latent_frames(input_frames: int, overlap_history: int, temporal: int, block: int) -> int:
    """The latent frames the input video's last `overlap_history` frames give (the causal VAE's 1 + (T - 1)
    // temporal), cut to whole causal blocks of `block` frames as Diffusers cuts them."""
    encoded = (min(input_frames, overlap_history) - 1) // temporal + 1
    return encoded - encoded % block


class SkyReelsV2VideoToVideoValidationStage(SkyReelsV2DiffusionForcingValidationStage):
    """Diffusion forcing's checks plus the input video (decoded images, at least one frame) and what Diffusers'
    video extension needs to run: `overlap_history` (the frames it continues from), shorter than a window,
    and `num_frames` giving more latent frames than the overlap (else Diffusers runs no window)."""

    takes_input_video = True

    def video_probe(self) -> VideoProbe:
        """One grey frame continued from that frame (`overlap_history` 1: one latent frame, fewer than the
        probe's `probe_frames` give)."""
        return VideoProbe(input_frames=1, extra=(("overlap_history", 1),))

    def probe_given_latent_frames(self) -> int:
        """The probe's one-frame input video: one latent frame (`overlap_history` 1)."""
        return 1

    def resolve(self, params: SamplingParams) -> SamplingParams:
        name = self.image_inputs.pipeline_name
        if not params.input_video:
            raise InvalidRequestError(
                f"{name} extends an input video and got none: pass it as DiffGenerator.generate(video=[...]), "
                "diffserve generate --video PATH, or POST /v1/videos' video (a file or a data URL)",
                param="video",
            )
        resolved = super().resolve(params)
        frames = list(resolved.input_video or [])
        for index, frame in enumerate(frames):
            if not isinstance(frame, Image.Image):
                raise InvalidRequestError(
                    f"{name}: input video frame {index} is a {type(frame).__name__}, not a decoded PIL image",
                    param="video",
                )
        resolved.input_video = [frame.convert("RGB") for frame in without_alpha(frames)]
        settings = skyreels_v2_df_settings(resolved)
        if settings.overlap_history is None:
            raise InvalidRequestError(
                f"{name} needs overlap_history in extra: the input video's last frames the extension "
                "continues from (17 or 37 recommended)",
                param="extra",
            )

        def latent(count: int) -> int:
            return (count - 1) // self.temporal + 1

        overlap, base = latent(settings.overlap_history), latent(settings.base_num_frames)
        if overlap >= base:
            raise InvalidRequestError(
                f"{name}: overlap_history {settings.overlap_history} ({overlap} latent frames) must be shorter "
                f"than a window (base_num_frames {settings.base_num_frames}: {base} latent frames)",
                param="extra",
            )
        total = latent(int(resolved.num_frames))
        if total <= overlap:
            raise InvalidRequestError(
                f"{name}: num_frames {resolved.num_frames} ({total} latent frames) must give more latent frames "
                f"than overlap_history {settings.overlap_history} ({overlap}): they count the continued "
                "frames too",
                param="num_frames",
            )
        return resolved


class SkyReelsV2VideoPrefixStage(Stage):
    """The input video at the output size (the output's leading frames, published at once by a streamed
    request: `publish_leading`) and its last `overlap_history` frames' latents, cut to whole causal blocks,
    as the first window's prefix (`condition_latents`, one copy per output)."""

    sets = ()

    def __init__(self, vae: nn.Module, temporal: int, dit_frames_per_block: int) -> None:
        self.vae = vae
        self.temporal = temporal
        self.dit_frames_per_block = dit_frames_per_block

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        assert p.input_video and p.height is not None and p.width is not None
        settings = skyreels_v2_df_settings(p)
        assert settings.overlap_history is not None
        pixels = video_pixels(p.input_video, p.height, p.width)
        latents = encode_condition(self.vae, pixels[:, :, -settings.overlap_history :])
        block = causal_block(settings, self.dit_frames_per_block)
        kept = prefix_latent_frames(len(p.input_video), settings.overlap_history, self.temporal, block)
        assert latents.shape[2] - latents.shape[2] % block == kept
        conditioning = SkyReelsV2VideoToVideoConditioning.of(req)
        conditioning.condition_latents = latents[:, :, :kept].repeat(req.batch_size, 1, 1, 1, 1)
        conditioning.leading_pixels = pixels
        if streams_output(req):  # final output pixels: the job's first chunk, long before its windows'
            assert req.on_decoded is not None
            publish_leading(req, req.on_decoded)
        return req


class SkyReelsV2DiffusionForcingVideoToVideoPipeline(SkyReelsV2DiffusionForcingPipeline):
    """Extends an input video (`input_video`) by diffusion forcing, in every mode of the text-to-video one
    (synchronous or asynchronous, one window or several); see the module's docstring for the frames. Its
    decode is the diffusion-forcing one (`SkyReelsV2ForcingDecodingStage`), which puts the input frames
    first and streams a streamed job's windows as they finish."""

    pipeline_name = "SkyReelsV2DiffusionForcingVideoToVideoPipeline"
    conditioning_type = SkyReelsV2VideoToVideoConditioning
    input_validation_cls = SkyReelsV2VideoToVideoValidationStage

    @staticmethod
    def default_sampling_params() -> SamplingParams:
        params = skyreels_v2_default_sampling_params()
        params.num_frames = DEFAULT_NUM_FRAMES
        return params

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        frames_per_block = int(context.get("transformer").config.num_frame_per_block)
        return [SkyReelsV2VideoPrefixStage(context.get("vae"), self.temporal, frames_per_block)]
