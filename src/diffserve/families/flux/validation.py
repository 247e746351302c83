"""FLUX.1's input validation: the shared rules (`InputValidationStage`) plus two that depend on the task a
FLUX.1 request runs, as Diffusers' FLUX.1 pipelines have them.

- The embedded guidance default. Diffusers' `FluxPipeline` and `FluxKontextPipeline` default to 3.5, but
  `FluxImg2ImgPipeline`, `FluxInpaintPipeline` and the ControlNet pipelines (`FluxControlNetPipeline` and
  its img2img and inpainting variants) to 7.0. diffserve serves all of them from one FLUX.1 folder, so a
  request that leaves `guidance_scale` unset gets the default of the Diffusers pipeline its inputs select:
  7.0 with an input image or a ControlNet, 3.5 otherwise. A folder's own default (`diffserve.json`) wins
  over both: it is the folder's choice for every task.
- The input image's own check (Kontext's size: `kontext_condition_size`), at submission rather than in
  the middle of the request's preparation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.stages.input_validation import InputValidationStage


class FluxInputValidationStage(InputValidationStage):
    """`InputValidationStage` with FLUX.1's task-dependent guidance default and input-image check (module
    docstring).

    `conditioned_guidance_scale`: the guidance default of a request with an input image or a ControlNet
    (None: the family default for every request). `input_image_check(image)`: raises InvalidRequestError
    for an input image (RGB, after the shared checks) the pipeline cannot read (None: every image)."""

    def __init__(
        self,
        *args: Any,
        conditioned_guidance_scale: float | None,
        input_image_check: Callable[[Image.Image], object] | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.conditioned_guidance_scale = conditioned_guidance_scale
        self.input_image_check = input_image_check

    def resolve(self, params: SamplingParams) -> SamplingParams:
        conditioned = bool(params.input_images) or bool(params.controlnets)
        if params.guidance_scale is None and conditioned and self.conditioned_guidance_scale is not None:
            params = replace(params, guidance_scale=self.conditioned_guidance_scale)
        resolved = super().resolve(params)
        if self.input_image_check is not None:
            for image in resolved.input_images or []:
                self.input_image_check(image)
        return resolved
