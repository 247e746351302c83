"""DenoisingStage: where a pipeline's denoising steps run (the engine calls its `denoise_step(reqs)`;
the stage is never run over one request), so a pipeline's stage list reads top to bottom."""

from __future__ import annotations

from collections.abc import Callable

from diffserve.request import Req
from diffserve.stages.base import Stage


class DenoisingStage(Stage):
    needs = ("latents", "schedule", "prompt_embeds")
    sets = ("latents",)

    def __init__(self, denoise_step: Callable[[list[Req]], None]) -> None:
        self.denoise_step = denoise_step

    def forward(self, req: Req) -> Req:
        raise TypeError(
            "the engine runs denoising steps through denoise_step(reqs), not as a stage over one request"
        )
