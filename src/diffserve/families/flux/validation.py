"""FLUX.1's input validation: the shared rules (`InputValidationStage`) plus its input image's own check
(Kontext's size: `kontext_condition_size`), at submission rather than in the middle of the request's
preparation.

The task-dependent defaults (Diffusers' `FluxPipeline` and `FluxKontextPipeline` default to an embedded
guidance of 3.5, its img2img, inpainting and ControlNet pipelines to 7.0) are the shared stage's
`task_defaults`, built by `FluxPipeline.task_defaults`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.stages.input_validation import InputValidationStage


class FluxInputValidationStage(InputValidationStage):
    """`InputValidationStage` with FLUX.1's input-image check: `input_image_check(image)` raises
    InvalidRequestError for an input image (RGB, after the shared checks) the pipeline cannot read (None:
    every image)."""

    def __init__(
        self, *args: Any, input_image_check: Callable[[Image.Image], object] | None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.input_image_check = input_image_check

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        if self.input_image_check is not None:
            for image in resolved.input_images or []:
                self.input_image_check(image)
        return resolved
