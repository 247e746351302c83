"""SANA's and SANA-Sprint's input validation: the shared rules, plus the request's `extra` settings
(`SanaSettings`) and Diffusers' size rule, which depends on resolution binning.

With binning (Diffusers' default) any height and width is accepted: the request is generated at its
nearest aspect-ratio bin (multiples of 32 pixels) and the images are resized and centre-cropped back to the
size asked. Without it, Diffusers' `check_inputs` requires multiples of 32, and the DiT needs whole patches
of the DC-AE's latents: both are the pipeline's pixel granularity.
"""

from __future__ import annotations

from typing import Any

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.sana.config import sana_settings
from diffserve.families.sana.resolution import ResolutionBinning
from diffserve.stages.input_validation import InputValidationStage


class SanaInputValidationStage(InputValidationStage):
    """`InputValidationStage` taking any positive size (its `pixel_multiple` is 1), then SANA's size rule:
    the generated size (the bin, or the size asked without binning) a multiple of `generation_multiple`."""

    takes_family_settings = True

    def __init__(
        self, *args: Any, binning: ResolutionBinning, generation_multiple: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, pixel_multiple=1, **kwargs)
        self.binning = binning
        self.generation_multiple = generation_multiple

    def generated_size(self, params: SamplingParams) -> tuple[int, int]:
        """The bin `use_resolution_binning` (on by default) generates at, else the size asked: what the
        latents, the DiT and the VAE's decode run at, and the memory model costs."""
        return self.binning.generation_size(params)

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        sana_settings(resolved)  # raises on unknown keys or bad values
        height, width = self.binning.generation_size(resolved)
        m = self.generation_multiple
        for name, value in (("height", height), ("width", width)):
            if not value % m:
                continue
            if self.binning.binned(resolved):
                raise InvalidRequestError(
                    f"extra['use_resolution_binning'] maps {resolved.height}x{resolved.width} to the bin "
                    f"{height}x{width}, whose {name} is not a multiple of {m} (this model's pixel granularity): "
                    "set it to false and ask for a multiple",
                    param="extra",
                )
            lower = max(m, value - value % m)
            raise InvalidRequestError(
                f"{name}={value} is not a multiple of {m} (this model's pixel granularity); try {lower} or "
                f"{lower + m}, or leave extra['use_resolution_binning'] on (the default): it takes any size",
                param=name,
            )
        return resolved
