"""What the runtime needs from a pipeline, declared and typed: its facts (`PipelineFacts`) and the
phases of the `EnginePipeline` protocol (`pipelines.base.Pipeline` implements it; tests use fakes).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req

#: When a family runs CFG's negative branch: "true_cfg" (FLUX, Qwen-Image) with true_cfg_scale > 1 and a
#: negative prompt; "classic" (SD3, Wan) when guidance_scale > 1; "positive_gap" (Z-Image) when
#: guidance_scale > 0. The last two default the negative prompt to "".
CfgMode = Literal["true_cfg", "classic", "positive_gap"]


@dataclass(frozen=True)
class PipelineFacts:
    """A loaded pipeline's fixed properties, as the runtime uses them."""

    #: The Diffusers pipeline class name it serves (for messages and metadata).
    name: str
    #: Height and width must be multiples of this; a latent token covers pixel_multiple² pixels.
    pixel_multiple: int
    #: The DiT's hidden width (heads x head dim): what one latent token's activations scale with.
    dit_width: int
    #: The dtype the DiT computes in.
    dtype: torch.dtype
    cfg_mode: CfgMode
    #: Input images a request must / may send (0 / 0: text-to-image or text-to-video).
    min_input_images: int = 0
    max_input_images: int = 0
    #: The outputs are videos (`num_frames`, `fps`, `video_format` apply).
    makes_video: bool = False
    #: Frames per latent frame after the first (`num_frames` = temporal_factor * k + 1); 1 for images.
    temporal_factor: int = 1
    #: The largest `num_frames` / `fps` a video family accepts (0 for image families).
    max_frames: int = 0
    max_fps: int = 0


class EnginePipeline(Protocol):
    """The phases the engine runs a request through, and the facts it plans with."""

    @property
    def facts(self) -> PipelineFacts: ...

    def validate(self, req: Req) -> Req:
        """Resolve and check `req.params` (InvalidRequestError) and set the request's generator, CFG
        decision and quality tier; once per request, before it is queued."""

    def run_pre_denoise(self, req: Req) -> Req:
        """Text and image encoding, latents and timesteps of a validated request."""

    def denoise_step(self, reqs: list[Req]) -> None:
        """One denoising step for every request of `reqs` (equal `batch_key`s) as one DiT batch."""

    def run_post_denoise(self, req: Req) -> Req:
        """Decoding, once the request's last step is done."""

    def batch_key(self, req: Req) -> Hashable:
        """Requests with equal keys may share a denoising step."""

    def preview_images(self, req: Req) -> list[Image.Image]:
        """What the request's outputs would be if sampling stopped after its current step."""


def resolved_params(pipeline: EnginePipeline, params: SamplingParams) -> SamplingParams:
    """`params` with the family's defaults applied and validated, without running anything."""
    return pipeline.validate(Req(params=params)).params
