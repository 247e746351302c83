"""InputValidationStage: fill family defaults, validate, and create the request's noise generator."""

from __future__ import annotations

import torch

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req
from diffserve.stages.base import Stage


class InputValidationStage(Stage):
    sets = ("generator", "do_true_cfg")

    def __init__(
        self,
        defaults: SamplingParams,
        pixel_multiple: int,
        default_pixels: int,
        max_sequence_length_limit: int | None,
    ) -> None:
        self.defaults = defaults
        self.pixel_multiple = pixel_multiple
        self.default_pixels = default_pixels
        self.max_sequence_length_limit = max_sequence_length_limit

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Family defaults applied and validated; raises InvalidRequestError on bad input."""
        resolved = params.with_defaults(self.defaults)
        if resolved.height is None:
            resolved.height = self.default_pixels
        if resolved.width is None:
            resolved.width = self.default_pixels
        resolved.validate(self.pixel_multiple, self.max_sequence_length_limit)
        return resolved

    def forward(self, req: Req) -> Req:
        req.params = self.resolve(req.params)
        # Noise is drawn from a CPU generator so a seed gives the same image on every device,
        # and matches Diffusers called with generator=torch.Generator("cpu").manual_seed(seed).
        req.generator = torch.Generator("cpu").manual_seed(req.params.seed)
        p = req.params
        req.do_true_cfg = bool(p.true_cfg_scale and p.true_cfg_scale > 1 and p.negative_prompt is not None)
        return req
