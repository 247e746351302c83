"""What the engine, the scheduler and the memory model need from a pipeline, declared and typed.

The runtime never inspects a pipeline's stages or guesses with `getattr`: a pipeline states its facts
once (`PipelineFacts`) and offers the phases of the `EnginePipeline` protocol. Pipelines in
`pipelines/` implement it through `pipelines.base.Pipeline`; tests implement it with fakes.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req

#: How a family runs classifier-free guidance (see `stages/input_validation.py`).
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
        """Resolve and check `req.params` (family defaults applied, InvalidRequestError on bad input) and
        set what the request's run depends on: its generator, CFG decision and quality tier. Runs once
        per request, before it is queued; the phases below never resolve parameters again."""

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
