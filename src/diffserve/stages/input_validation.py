"""InputValidationStage: fill family defaults, validate, and create the request's noise generator."""

from __future__ import annotations

import torch

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req
from diffserve.stages.base import Stage


class InputValidationStage(Stage):
    sets = ("generator", "do_cfg")

    def __init__(
        self,
        defaults: SamplingParams,
        pixel_multiple: int,
        default_pixels: int,
        max_sequence_length_limit: int | None,
        classic_cfg: bool = False,
    ) -> None:
        """`classic_cfg`: CFG runs whenever guidance_scale > 1, with "" as the default negative prompt
        (SD3). Otherwise (FLUX) guidance_scale is embedded and CFG runs only with true_cfg_scale > 1
        and a negative prompt."""
        self.defaults = defaults
        self.pixel_multiple = pixel_multiple
        self.default_pixels = default_pixels
        self.max_sequence_length_limit = max_sequence_length_limit
        self.classic_cfg = classic_cfg

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
        if self.classic_cfg:
            req.do_cfg = bool(p.guidance_scale is not None and p.guidance_scale > 1)
            req.cfg_scale = float(p.guidance_scale or 1.0)
            if req.do_cfg and p.negative_prompt is None:
                p.negative_prompt = ""
        else:
            req.do_cfg = bool(p.true_cfg_scale and p.true_cfg_scale > 1 and p.negative_prompt is not None)
            req.cfg_scale = float(p.true_cfg_scale or 1.0)
        return req
