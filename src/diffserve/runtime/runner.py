"""`ModelRunner`: executes one pipeline phase for the requests the scheduler chose.

The runner is the part of the engine that touches models: validation, pre-denoise, one denoising step
over a DiT batch, post-denoise. It holds no queues, threads or transport, so the same runner can run
on every rank of a multi-device engine, each executing the step the rank-0 scheduler decided.

Step times are read without waiting for the device: `StepTimer` puts marks in the device's work
queue and reads them once the device has passed them, so the host queues step i + 1 while the
device still runs step i. `flush()` waits for the outstanding marks (once per finished request).

Every phase runs inside `model_scope()`: the generator's attention backend made active for the calling
thread only (`layers/attention.py`), so two engines in one process, on different threads or one after
the other, never run their models with each other's backend.
"""

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
        #: The backend `attention()` uses in this runner's phases (resolved once by the generator).
        self.attention_backend = AttentionBackend(attention_backend)
        #: Step times of every batch's steps, in the order they ran (one device queue).
        self.step_timer = StepTimer(platform)

    def model_scope(self) -> AbstractContextManager[AttentionBackend]:
        """The scope this runner's model calls run in (its attention backend, for the calling thread).
        Enter it around any other call into the pipeline's models, e.g. previews."""
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
        self.flush_step_times()  # its last steps' times (waits for its last step, once)
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
