"""What the runtime needs from a pipeline: its `PipelineFacts` and the `EnginePipeline` phases."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req

# When CFG's negative branch runs: "true_cfg" (FLUX, Qwen-Image): true_cfg_scale > 1 and a negative
# prompt; "classic" (SD3, Wan): guidance_scale > 1; "positive_gap" (Z-Image): guidance_scale > 0; "none"
# (guidance-distilled: FLUX.2-dev, a step-distilled FLUX.2 klein, SANA-Sprint): never.
CfgMode = Literal["true_cfg", "classic", "positive_gap", "none"]


@dataclass(frozen=True)
class VideoProbe:
    """What a probe request (warm-up, calibration, /health_generate, /server_info's defaults) of a family that
    extends an input video adds so that the family accepts it: a plain grey clip of `input_frames` frames
    and the family settings (`SamplingParams.extra`) the extension needs (SkyReels-V2's `overlap_history`)."""

    input_frames: int
    extra: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class PipelineFacts:
    """A loaded pipeline's fixed properties, as the runtime uses them."""

    name: str  # the Diffusers pipeline class name
    pixel_multiple: int  # height and width must be multiples; a latent token covers its square in pixels
    dit_width: int  # heads x head dim: what one latent token's activations scale with
    dtype: torch.dtype  # the DiT's
    cfg_mode: CfgMode
    min_input_images: int = 0  # input images a request must / may send
    max_input_images: int = 0
    requires_mask: bool = False  # FLUX.1 Fill: every request carries an inpainting mask
    inpainting: bool = False  # requests may carry an inpainting mask (FLUX.1, Fill, SD3, Z-Image, Qwen-Image)
    makes_video: bool = False
    temporal_factor: int = 1  # `num_frames` = temporal_factor * k + 1; 1 for images
    max_frames: int = 0
    max_fps: int = 0
    video_probe: VideoProbe | None = None  # a family that extends an input video (video-to-video)
    #: A video family's frames in a probe request (warm-up, calibration, /health_generate, the batch
    #: policy's measurement): the fewest that leave at least one denoising step (1 for most; more where the
    #: first frames come given, as diffusion forcing's input image, and a window is whole causal blocks).
    probe_frames: int = 1
    #: Denoising steps in a probe request: the fewest the family's schedule accepts (1 for most; Mochi's
    #: linear-quadratic schedule needs 2). Every probe runs at least this many.
    probe_steps: int = 1
    #: Family settings (`SamplingParams.extra`) every probe request sets so that the family runs it at the
    #: size it asks for, as its memory cost (`runtime.memory.request_cost`) counts it: SANA-Video's
    #: resolution binning off (it would generate any probe at one 480p bin, refused as no multiple of 32).
    probe_extra: tuple[tuple[str, object], ...] = ()
    #: (height, width) every probe request asks for, where the family generates one size only (CogVideoX
    #: 1.0-5B-I2V: its DiT's learned positions cover its sample size alone); None: square probes of the side
    #: each probe chooses (the warm-up's, calibration's two, /health_generate's).
    probe_size: tuple[int, int] | None = None

    def probe_side_size(self, side: int) -> tuple[int, int]:
        """(height, width) of a probe that asks for a `side`-pixel square: `probe_size` where the family
        declares one, else the square."""
        return self.probe_size or (side, side)

    def probe_images(self, width: int, height: int) -> list[Image.Image] | None:
        """Plain grey input images for a warm-up or health probe of a family that requires them (edit,
        image-to-video); None for families that take none."""
        if self.min_input_images == 0:
            return None
        return [Image.new("RGB", (width, height), (128, 128, 128)) for _ in range(self.min_input_images)]

    def probe_mask(self, width: int, height: int) -> Image.Image | None:
        """An all-white mask (repaint everything) for a probe of a family that requires one; else None."""
        return Image.new("L", (width, height), 255) if self.requires_mask else None

    def with_probe_settings(self, params: SamplingParams) -> SamplingParams:
        """`params` (changed in place, and returned) as every probe request of this family must be: at least
        `probe_steps` denoising steps where a step count is set (None keeps the family's default), and the
        `probe_extra` settings where `extra` lacks them. Families that declare neither are unchanged."""
        steps = params.num_inference_steps
        if steps is not None and steps < self.probe_steps:
            params.num_inference_steps = self.probe_steps
        if self.probe_extra:
            params.extra = {**dict(self.probe_extra), **(params.extra or {})}
        return params

    def with_probe_video(
        self, params: SamplingParams, width: int, height: int, set_frames: bool = True
    ) -> SamplingParams:
        """`params` (changed in place, and returned) with what a probe of a family that extends an input
        video needs: a grey `width` x `height` input video where none is given, the `video_probe`'s family
        settings where `extra` lacks them and, with `set_frames`, its `probe_frames` (at least one chunk
        after the first frame: a one-frame clip is no extension). Other families' params are returned
        unchanged."""
        probe = self.video_probe
        if probe is None:
            return params
        if params.input_video is None:
            frame = Image.new("RGB", (width, height), (128, 128, 128))
            params.input_video = [frame] * probe.input_frames
        params.extra = {**dict(probe.extra), **(params.extra or {})}
        if set_frames:
            params.num_frames = self.probe_frames
        return params


class EnginePipeline(Protocol):
    """The phases the engine runs a request through, and the facts it plans with."""

    @property
    def facts(self) -> PipelineFacts: ...

    def validate(self, req: Req) -> Req:
        """Resolve and check `req.params` (InvalidRequestError); set generator, CFG and quality tier."""

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
