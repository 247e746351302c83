"""`ModelRunner`: the part of the engine that touches models, one pipeline phase at a time, inside
`model_scope()` (the attention backend); step times come from `StepTimer` marks (no host sync per step)."""

from __future__ import annotations

from contextlib import AbstractContextManager

from PIL import Image

from diffserve.layers.attention import AttentionBackend, attention_backend_scope
from diffserve.platforms.base import Platform
from diffserve.platforms.step_timer import StepTimer
from diffserve.request import Req
from diffserve.runtime.contract import EnginePipeline


class ModelRunner:
    def __init__(
        self, pipeline: EnginePipeline, platform: Platform, attention_backend: AttentionBackend
    ) -> None:
        self.pipeline = pipeline
        self.platform = platform
        self.attention_backend = AttentionBackend(attention_backend)
        self.step_timer = StepTimer(platform)

    def model_scope(self) -> AbstractContextManager[AttentionBackend]:
        """The scope this runner's model calls run in; enter it around any other call into the models."""
        return attention_backend_scope(self.attention_backend)

    def validate(self, req: Req) -> Req:
        with self.model_scope():
            return self.pipeline.validate(req)

    def pre_denoise(self, req: Req) -> Req:
        with self.model_scope():
            return self.pipeline.run_pre_denoise(req)

    def denoise_step(self, reqs: list[Req]) -> None:
        """One DiT batch over `reqs`; each request's `step_times` gets this step's time when it is known."""
        with self.model_scope():
            start = self.step_timer.start()
            self.pipeline.denoise_step(reqs)
            self.step_timer.stop(start, *(req.step_times for req in reqs))

    def post_denoise(self, req: Req) -> Req:
        with self.model_scope():
            return self.pipeline.run_post_denoise(req)

    def preview_images(self, req: Req) -> list[Image.Image]:
        """What the request's outputs would be if sampling stopped after its current step."""
        with self.model_scope():
            return self.pipeline.preview_images(req)

    def flush_step_times(self) -> None:
        self.step_timer.flush()

    def reset_peak_memory(self) -> None:
        self.platform.reset_peak_memory()

    def peak_memory_bytes(self) -> int | None:
        return self.platform.memory_info().peak_bytes
