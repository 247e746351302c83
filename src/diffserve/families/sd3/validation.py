"""SD3's input validation: the shared one-image rules (text-to-image, image-to-image, inpainting), plus the
largest image its DiT can place. (Diffusers' `StableDiffusion3Img2ImgPipeline` and
`StableDiffusion3InpaintPipeline` default to 50 steps, its text-to-image pipeline to 28: the pipeline gives
the former as the shared stage's `task_defaults`.)

SD3's DiT adds a learned-size position table of `pos_embed_max_size` x `pos_embed_max_size` patches, cropped
to the centre of the latent grid; a grid wider or taller than the table has no positions. Diffusers' patch
embedding raises on such a grid ("Height (N) cannot be greater than `pos_embed_max_size`") in the first DiT
forward; here the request is refused at submission, naming the side and the largest size the model takes,
before any model work (and before the memory model costs it).
"""

from __future__ import annotations

from typing import Any

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.stages.input_validation import InputValidationStage


class SD3InputValidationStage(InputValidationStage):
    """`InputValidationStage` with SD3's bound on height and width (`max_side` pixels; None: no bound, a DiT
    without a position table computes its positions for any grid)."""

    def __init__(self, *args: Any, max_side: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_side = max_side

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        if self.max_side is None:
            return resolved
        for name in ("height", "width"):
            value = getattr(resolved, name)
            if value <= self.max_side:
                continue
            patches = self.max_side // self.pixel_multiple
            table = f"its DiT's position table covers {patches} patches of {self.pixel_multiple}"
            if getattr(params, name) is not None:
                what, advice = (
                    f"{name}={value}",
                    f" (Diffusers refuses it too); ask for {self.max_side} or less",
                )
            else:
                what, advice = (
                    f"{name}={value} (the input image's, floored)",
                    "; pass a smaller height and width",
                )
            raise InvalidRequestError(
                f"{what} is larger than this model's largest side, {self.max_side} pixels: {table} pixels a side"
                f"{advice}",
                param=name,
            )
        return resolved
