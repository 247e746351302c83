"""DenoisingStage: marks where a pipeline's denoising steps run, and holds its batched step function.

The engine (runtime/engine.py) runs every request's steps, alone or in a DiT batch with others, by
calling `denoise_step(reqs)`; the stage itself is never run over a single request. It stays in the
stage list so a pipeline reads top to bottom: what runs before the steps, the steps, what runs after.
"""

from __future__ import annotations

from collections.abc import Callable

from diffserve.request import Req
from diffserve.stages.base import Stage

DenoiseStep = Callable[[list[Req]], None]


class DenoisingStage(Stage):
    needs = ("latents", "sigmas", "timesteps", "prompt_embeds")
    sets = ("latents",)

    def __init__(self, denoise_step: DenoiseStep) -> None:
        self.denoise_step = denoise_step

    def forward(self, req: Req) -> Req:
        raise TypeError(
            "the engine runs denoising steps through denoise_step(reqs), not as a stage over one request"
        )
