"""SkyReels-V2 (Skywork; Diffusers `SkyReelsV2Pipeline`, `SkyReelsV2ImageToVideoPipeline`,
`SkyReelsV2DiffusionForcingPipeline`): Wan 2.1's pipelines over SkyReels-V2's DiT
(`models/dits/skyreels_v2.py`), the Wan VAE and UniPC.

Diffusers' text-to-video and image-to-video pipelines are Wan 2.1's (first frame, CLIP image states) step for
step, with their own defaults: 544x960, 97 frames, 50 steps, CFG 6.0 (text-to-video) or 5.0
(image-to-video), 24 fps output. The image-to-video default size is 544x960 whatever the image's aspect
ratio (Diffusers' default), not Wan's area-preserving size. Neither passes `fps` to the DiT.

Diffusion forcing is served in its synchronous one-window mode (`ar_step` 0, at most `base_num_frames`
frames): every latent frame runs the same schedule, so a request is a text-to-video request whose DiT call
gives each frame its timestep and the fps index; Diffusers steps one scheduler per frame, which this
reproduces (`SkyReelsV2DiffusionForcingDenoiser._step`). The asynchronous (`ar_step` > 0) and long-video
(`overlap_history`) modes, whose frames run different schedules, are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffserve.configs.option import option, settings_from
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.config import WanPipelineConfig
from diffserve.families.wan.pipeline import WanDenoiser, WanImageToVideoPipeline, WanPipeline
from diffserve.pipelines.base import PipelineContext
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.input_validation import InputValidationStage


@dataclass(frozen=True)
class SkyReelsV2PipelineConfig(WanPipelineConfig):
    #: Diffusers' SkyReels-V2 pipelines default to 544x960 (height x width).
    default_height: int = 544
    default_width: int = 960


def skyreels_v2_default_sampling_params(guidance_scale: float = 6.0) -> SamplingParams:
    """Defaults of Diffusers' SkyReelsV2Pipeline.__call__ (image-to-video: guidance 5.0); 24 fps is
    SkyReels-V2's frame rate."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=guidance_scale,
        max_sequence_length=512,
        num_frames=97,
        fps=24,
        video_format="mp4",
    )


class SkyReelsV2Pipeline(WanPipeline):
    """Text-to-video."""

    config = SkyReelsV2PipelineConfig()
    pipeline_name = "SkyReelsV2Pipeline"

    @staticmethod
    def default_sampling_params() -> SamplingParams:
        return skyreels_v2_default_sampling_params()


class SkyReelsV2ImageToVideoPipeline(WanImageToVideoPipeline):
    """Animates one input image (Diffusers' optional `last_image` is not served, as for Wan)."""

    config = SkyReelsV2PipelineConfig()
    pipeline_name = "SkyReelsV2ImageToVideoPipeline"

    @staticmethod
    def default_sampling_params() -> SamplingParams:
        return skyreels_v2_default_sampling_params(guidance_scale=5.0)

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        return self.config.default_height, self.config.default_width


@dataclass(frozen=True)
class SkyReelsV2DiffusionForcingSettings:
    """One diffusion-forcing request's settings beyond SamplingParams (Diffusers' `__call__` arguments and
    defaults), set in `SamplingParams.extra`. Served: the synchronous mode over one window (`ar_step` 0, at
    most `base_num_frames` frames); the asynchronous and the long-video (`overlap_history`) modes are refused."""

    ar_step: int = option(
        0, help="asynchronous diffusion forcing's lag between frame blocks (only 0 is served)", min=0
    )
    causal_block_size: int | None = option(
        None,
        help="frames per causal block (None: the DiT's num_frame_per_block; another value is refused)",
        min=1,
    )
    base_num_frames: int = option(97, help="the frames of one window (97 for 540P, 121 for 720P)", min=1)
    overlap_history: int | None = option(
        None, help="long videos' overlap between windows (long videos are not served yet)", min=1
    )
    addnoise_condition: float = option(
        0.0, help="noise added to long videos' conditioning frames (no effect on one window)", min=0.0
    )


def skyreels_v2_df_settings(params: SamplingParams) -> SkyReelsV2DiffusionForcingSettings:
    """The request's settings from `params.extra` (an unknown key or a bad value: InvalidRequestError)."""
    return settings_from(SkyReelsV2DiffusionForcingSettings, params.extra, "extra")


class SkyReelsV2DiffusionForcingValidationStage(InputValidationStage):
    """The shared validation plus the diffusion-forcing settings: the served (synchronous, one-window) mode
    only, and a latent frame count the DiT's causal blocks divide."""

    takes_family_settings = True
    #: The DiT's frames per causal block and the VAE's temporal factor, set by the pipeline.
    frames_per_block: int = 1
    temporal: int = 4

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        settings = skyreels_v2_df_settings(resolved)
        if settings.ar_step != 0:
            raise InvalidRequestError(
                "asynchronous diffusion forcing (ar_step > 0) is not served yet; use ar_step 0", param="extra"
            )
        if settings.causal_block_size not in (None, self.frames_per_block):
            raise InvalidRequestError(
                f"causal_block_size must be the DiT's num_frame_per_block ({self.frames_per_block}) or unset",
                param="extra",
            )
        frames = int(resolved.num_frames)
        if frames > settings.base_num_frames:
            raise InvalidRequestError(
                f"num_frames {frames} exceeds base_num_frames {settings.base_num_frames}: long videos "
                "(overlap_history) are not served yet",
                param="num_frames",
            )
        latent_frames = (frames - 1) // self.temporal + 1
        if latent_frames % self.frames_per_block:
            raise InvalidRequestError(
                f"num_frames {frames} gives {latent_frames} latent frames, not a multiple of the DiT's causal "
                f"block ({self.frames_per_block} frames)",
                param="num_frames",
            )
        return resolved


class SkyReelsV2DiffusionForcingDenoiser(WanDenoiser):
    """Every latent frame at the step's timestep, given per frame (Diffusers' diffusion-forcing DiT call),
    with the fps index (0 for 16 fps, 1 otherwise) the DiT injects."""

    def timestep_rows(self, req: Req) -> torch.Tensor:
        t = req.schedule.timesteps[req.step_index]
        frames = req.latents.shape[2] // self.patch[0]
        return t.expand(req.batch_size, frames)

    def _step(self, expert: int, reqs: list[Req]) -> None:
        super()._step(expert, reqs)
        for req in reqs:
            state = req.scheduler_state
            if req.step_index == 1 and getattr(state, "last_sample", None) is not None:
                # Diffusers steps one UniPC scheduler per latent frame on a view of its latents' frame and
                # writes the result back into that frame in place, so the first step's remembered sample
                # (the view) becomes the step's output: the second step's corrector starts from it.
                state.last_sample = req.latents

    def extra_dit_inputs(self, reqs: list[Req]) -> dict[str, Any]:
        rows = []
        for req in reqs:
            index = 0 if req.params.fps == 16 else 1
            rows += [index] * (req.batch_size * (2 if req.do_cfg else 1))
        return {"fps": torch.tensor(rows, dtype=torch.long, device=reqs[0].latents.device)}


class SkyReelsV2DiffusionForcingPipeline(SkyReelsV2Pipeline):
    """Text-to-video with the diffusion-forcing DiT (Diffusers' `SkyReelsV2DiffusionForcingPipeline`) in its
    synchronous one-window mode: every latent frame runs the same schedule, each frame's tokens at its
    frame's timestep, fps injected. No quality tiers (block-causal attention runs every block)."""

    pipeline_name = "SkyReelsV2DiffusionForcingPipeline"
    denoiser_cls = SkyReelsV2DiffusionForcingDenoiser
    input_validation_cls = SkyReelsV2DiffusionForcingValidationStage
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {}

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        stages = super().build_stages(context)
        validation = self.input_validation
        assert isinstance(validation, SkyReelsV2DiffusionForcingValidationStage)
        validation.frames_per_block = int(context.get("transformer").config.num_frame_per_block)
        validation.temporal = self.temporal
        return stages
