"""Stand-ins for a loaded model, for tests of the engine and the server without model work.

`FakePipeline` implements the engine's `EnginePipeline` contract: it validates like a family (defaults,
pixel multiple, input images), counts `num_inference_steps` steps, and returns flat images or black
videos. `FakeGenerator` carries it with an `Engine`, as `DiffGenerator` does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.layers.attention import AttentionBackend
from diffserve.platforms.base import Platform
from diffserve.platforms.cpu import CpuPlatform
from diffserve.request import Req, Schedule
from diffserve.runtime import Engine, PipelineFacts, SchedulerConfig

#: A request with this prompt fails in its pre-denoise phase (tests of failure isolation).
FAILING_PROMPT = "boom"


def image_facts(
    name: str = "FakePipeline", min_input_images: int = 0, max_input_images: int = 0
) -> PipelineFacts:
    return PipelineFacts(
        name=name, pixel_multiple=16, dit_width=64, dtype=torch.float32, cfg_mode="true_cfg",
        min_input_images=min_input_images, max_input_images=max_input_images,
    )  # fmt: skip


def video_facts(name: str = "FakeVideoPipeline") -> PipelineFacts:
    return PipelineFacts(
        name=name, pixel_multiple=16, dit_width=64, dtype=torch.float32, cfg_mode="classic",
        makes_video=True, temporal_factor=4, max_frames=1025, max_fps=120,
    )  # fmt: skip


class FakePipeline:
    def __init__(self, facts: PipelineFacts | None = None, defaults: SamplingParams | None = None) -> None:
        self._facts = facts or image_facts()
        video = {"num_frames": 5, "fps": 8, "video_format": "mp4"} if self._facts.makes_video else {}
        self.defaults = defaults or SamplingParams(num_inference_steps=3, height=32, width=32, **video)
        #: Called inside every step for every request (tests cancel there).
        self.on_step: Callable[[Req], None] = lambda req: None

    @property
    def facts(self) -> PipelineFacts:
        return self._facts

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        images = params.input_images or []
        if len(images) < self._facts.min_input_images:
            raise InvalidRequestError(f"{self._facts.name} needs an input image", param="image")
        resolved = params.with_defaults(self.defaults)
        if images and params.height is None and params.width is None:
            resolved.width, resolved.height = images[0].size
        resolved.validate(self._facts.pixel_multiple)
        return resolved

    def validate(self, req: Req) -> Req:
        req.params = self.resolve_params(req.params)
        req.do_cfg = False
        return req

    def run_pre_denoise(self, req: Req) -> Req:
        if req.params.prompt == FAILING_PROMPT:
            raise RuntimeError("kaboom")
        req.schedule = Schedule.of_length(int(req.params.num_inference_steps))
        req.timings.stages["FakeStage"] = 0.01
        return req

    def denoise_step(self, reqs: list[Req]) -> None:
        for req in reqs:
            req.step_index += 1
            self.on_step(req)

    def run_post_denoise(self, req: Req) -> Req:
        p = req.params
        if self._facts.makes_video:
            req.outputs.frames = [np.zeros((p.num_frames, p.height, p.width, 3), np.uint8)]
        else:
            req.outputs.images = [
                Image.new("RGB", (p.width, p.height), (i * 40, 0, 0)) for i in range(p.num_outputs_per_prompt)
            ]
        return req

    def batch_key(self, req: Req) -> Hashable:
        return (req.params.height, req.params.width, req.params.num_frames)

    def preview_images(self, req: Req) -> list[Image.Image]:
        p = req.params
        return [Image.new("RGB", (p.width, p.height)) for _ in range(p.num_outputs_per_prompt)]


@dataclass(frozen=True)
class FakeFamily:
    name: str = "fake"
    diffusers_pipeline: str = "FakePipeline"
    task: str = "text-to-image"


class FakeGenerator:
    """What the server's engine process reads of a `DiffGenerator`."""

    model_path = "/fake/model"
    dtype = torch.float32

    def __init__(
        self,
        pipeline: FakePipeline | None = None,
        family: FakeFamily | None = None,
        config: SchedulerConfig | None = None,
    ) -> None:
        self.pipeline = pipeline or FakePipeline()
        self.family = family or FakeFamily()
        self.platform: Platform = CpuPlatform()
        self.engine = Engine(
            self.pipeline,
            self.platform,
            # Its steps take no time: the measured policy would choose on noise; this one batches.
            config or SchedulerConfig(max_batch_tokens=16384, batch_policy="throughput"),
            attention_backend=AttentionBackend.SDPA,
        )

    def close(self) -> None:
        """One device: no rank processes to stop."""
