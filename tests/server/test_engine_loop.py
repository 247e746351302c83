"""The engine loop in-process, with a stand-in generator: validation before queueing, FIFO order,
cancellation of waiting and running requests, and one failing request not affecting the next."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from PIL import Image

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import RequestCancelledError
from diffserve.server.engine_process import Engine, EngineProcessConfig
from diffserve.server.protocol import (
    CancelJob,
    GenerateJob,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobRejected,
    JobStarted,
    ShutdownEngine,
)


class FakePipeline:
    pixel_multiple = 16

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        resolved = params.with_defaults(SamplingParams(num_inference_steps=3, height=32, width=32))
        resolved.validate(16)
        return resolved


class FakeGenerator:
    """Runs `num_inference_steps` fake steps, honouring the request's cancel_event like DenoisingStage."""

    model_path = "/fake/model"
    family = SimpleNamespace(name="fake", diffusers_pipeline="FakePipeline", task="text-to-image")
    platform = SimpleNamespace(name="cpu", device_name=lambda: "test-cpu")
    dtype = "torch.float32"

    def __init__(self) -> None:
        self.pipeline = FakePipeline()
        self.on_step = lambda req: None

    def generate_from_params(self, params: SamplingParams, request=None):
        resolved = self.pipeline.resolve_params(params)
        if resolved.prompt == "boom":
            raise RuntimeError("kaboom")
        for _ in range(resolved.num_inference_steps):
            if request is not None and request.cancelled:
                raise RequestCancelledError("cancelled")
            if request is not None:
                request.step_index += 1
                self.on_step(request)
        images = [Image.new("RGB", (resolved.width, resolved.height), (i * 40, 0, 0))
                  for i in range(resolved.num_outputs_per_prompt)]
        return SimpleNamespace(images=images, params=resolved, timings={"FakeStage": 0.01},
                               step_times=[0.001] * resolved.num_inference_steps, peak_memory_mb=1.5)


class FakeChannel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)

    def of(self, kind: type, request_id: str | None = None) -> list:
        return [m for m in self.sent if isinstance(m, kind) and (request_id is None or m.request_id == request_id)]


@pytest.fixture
def engine(tmp_path):
    config = EngineProcessConfig(EngineArgs(model_path="/fake/model", output_path=str(tmp_path)), "", "", 1)
    return Engine(config, FakeChannel(), generator=FakeGenerator())


def job(rid: str, prompt: str = "a cat", **kwargs) -> GenerateJob:
    fields = {k: kwargs.pop(k) for k in ("response_format", "output_compression") if k in kwargs}
    return GenerateJob(request_id=rid, params=SamplingParams(prompt=prompt, **kwargs), **fields)


def run_next(engine: Engine) -> None:
    queued = engine.queue.pop(timeout=0)
    assert queued is not None
    try:
        engine._run(queued)
    finally:
        engine.queue.finish(queued.request_id)


def test_invalid_params_are_rejected_before_queueing(engine) -> None:
    engine._handle(job("r1", width=40))
    [rejected] = engine.channel.of(JobRejected, "r1")
    assert "width=40 is not a multiple of 16" in rejected.message and rejected.param == "width"
    assert engine.queue.num_waiting == 0


def test_requests_run_in_order_and_a_failure_does_not_affect_the_next(engine) -> None:
    engine._handle(job("bad", prompt="boom"))
    engine._handle(job("good", num_outputs_per_prompt=2))
    run_next(engine)
    run_next(engine)
    assert [type(m).__name__ for m in engine.channel.sent] == ["JobStarted", "JobFailed", "JobStarted", "JobFinished"]
    [failed] = engine.channel.of(JobFailed, "bad")
    assert failed.message == "RuntimeError: kaboom" and not failed.user_error
    [finished] = engine.channel.of(JobFinished, "good")
    assert len(finished.images) == 2 and finished.images[0].content_type == "image/png"
    assert finished.images[0].data.startswith(b"\x89PNG") and finished.params.height == 32
    assert finished.peak_memory_bytes == int(1.5 * 2**20) and finished.step_times == [0.001] * 3


def test_cancel_while_waiting_answers_at_once(engine) -> None:
    engine._handle(job("r1"))
    engine._handle(job("r2"))
    engine._handle(CancelJob("r2"))
    assert [m.request_id for m in engine.channel.of(JobCancelled)] == ["r2"]
    run_next(engine)
    assert engine.queue.pop(timeout=0) is None
    assert not engine.channel.of(JobStarted, "r2")


def test_cancel_while_running_stops_at_the_next_step(engine) -> None:
    engine.generator.on_step = lambda req: engine._handle(CancelJob(req.request_id)) if req.step_index == 1 else None
    engine._handle(job("r1", num_inference_steps=50))
    run_next(engine)
    [cancelled] = engine.channel.of(JobCancelled, "r1")
    assert cancelled.at_step == 1
    assert not engine.channel.of(JobFinished)


def test_url_responses_are_written_to_the_output_dir(engine, tmp_path) -> None:
    engine._handle(job("0" * 32, response_format="url", output_format="webp", output_compression=50))
    run_next(engine)
    [finished] = engine.channel.of(JobFinished)
    [image] = finished.images
    assert image.data is None and image.image_id == "0" * 32 + "-0" and image.content_type == "image/webp"
    assert (tmp_path / f"{image.image_id}.webp").is_file()
    assert not list(tmp_path.glob("*.partial"))


def test_shutdown_cancels_waiting_requests(engine) -> None:
    engine._handle(job("r1"))
    engine._handle(job("r2"))
    engine._handle(ShutdownEngine())
    assert engine.stop.is_set()
    assert sorted(m.request_id for m in engine.channel.of(JobCancelled)) == ["r1", "r2"]


def test_info_reports_defaults_and_granularity(engine) -> None:
    info = engine.info(warmup_seconds=0.5)
    assert info["pixel_multiple"] == 16 and engine.probe_size == 64
    assert info["default_params"]["num_inference_steps"] == 3 and "prompt" not in info["default_params"]
    assert info["dtype"] == "float32" and info["platform"] == "cpu"
    assert type(info["versions"]["torch"]) is str  # a plain str: unpickling it must not import torch
