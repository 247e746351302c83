"""The engine loop in-process, with a stand-in pipeline: validation before queueing, FIFO order,
cancellation of waiting and running requests, and one failing request not affecting the next."""

from __future__ import annotations

import pytest

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.runtime import SchedulerConfig
from diffserve.server.engine_process import EngineProcess, EngineProcessConfig
from diffserve.server.protocol import (
    CancelJob,
    GenerateJob,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobProgress,
    JobRejected,
    JobStarted,
    ShutdownEngine,
)
from diffserve.testing.fake_pipeline import FakeGenerator


class FakeChannel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)

    def of(self, kind: type, request_id: str | None = None) -> list:
        return [
            m for m in self.sent if isinstance(m, kind) and (request_id is None or m.request_id == request_id)
        ]


@pytest.fixture
def engine(tmp_path):
    config = EngineProcessConfig(EngineArgs(model_path="/fake/model", output_path=str(tmp_path)), "", "", 1)
    return EngineProcess(config, FakeChannel(), generator=FakeGenerator())


def job(rid: str, prompt: str = "a cat", **kwargs) -> GenerateJob:
    fields = {k: kwargs.pop(k) for k in ("response_format", "output_compression") if k in kwargs}
    return GenerateJob(request_id=rid, params=SamplingParams(prompt=prompt, **kwargs), **fields)


def outcomes(engine: EngineProcess) -> list[str]:
    return [type(m).__name__ for m in engine.channel.sent if not isinstance(m, JobProgress)]


def test_invalid_params_are_rejected_before_queueing(engine) -> None:
    engine._handle(job("r1", width=40))
    [rejected] = engine.channel.of(JobRejected, "r1")
    assert "width=40 is not a multiple of 16" in rejected.message and rejected.param == "width"
    assert engine.scheduler.num_waiting == 0


def test_requests_run_in_order_and_a_failure_does_not_affect_the_next(engine) -> None:
    engine._handle(job("bad", prompt="boom"))
    engine._handle(job("good", num_outputs_per_prompt=2))
    engine.run_until_idle()
    assert outcomes(engine) == ["JobStarted", "JobFailed", "JobStarted", "JobFinished"]
    [failed] = engine.channel.of(JobFailed, "bad")
    assert failed.message == "RuntimeError: kaboom" and not failed.user_error
    [finished] = engine.channel.of(JobFinished, "good")
    assert len(finished.images) == 2 and finished.images[0].content_type == "image/png"
    assert finished.images[0].data.startswith(b"\x89PNG") and finished.params.height == 32
    assert (
        finished.peak_memory_bytes > 0 and len(finished.step_times) == 3 and finished.batch_sizes == [1] * 3
    )
    assert [(m.step, m.total, m.phase) for m in engine.channel.of(JobProgress, "good")] == [
        (1, 3, "denoising"),
        (2, 3, "denoising"),
        (3, 3, "decoding"),
    ]


def test_requests_share_steps_and_finish_on_their_own_step_counts(engine) -> None:
    engine._handle(job("a", num_inference_steps=2))
    engine._handle(job("b", num_inference_steps=4))
    engine._handle(job("c", num_inference_steps=3, height=48))  # another shape: its own batches
    engine.run_until_idle()
    by_id = {m.request_id: m for m in engine.channel.of(JobFinished)}
    assert by_id["a"].batch_sizes == [2, 2] and by_id["b"].batch_sizes == [2, 2, 1, 1]
    assert by_id["c"].batch_sizes == [1, 1, 1]
    assert engine.info(None)["scheduler"]["max_running_requests"] == 8


def test_max_running_requests_1_runs_one_at_a_time(tmp_path) -> None:
    args = EngineArgs(model_path="/fake/model", output_path=str(tmp_path), max_running_requests=1)
    generator = FakeGenerator(config=SchedulerConfig(max_running_requests=1))
    engine = EngineProcess(EngineProcessConfig(args, "", "", 1), FakeChannel(), generator=generator)
    for rid in ("r1", "r2", "r3"):
        engine._handle(job(rid))
    engine.run_until_idle()
    assert outcomes(engine) == ["JobStarted", "JobFinished"] * 3
    assert all(m.batch_sizes == [1] * 3 for m in engine.channel.of(JobFinished))


def test_priority_jobs_start_first(tmp_path) -> None:
    args = EngineArgs(model_path="/fake/model", output_path=str(tmp_path), max_running_requests=1)
    generator = FakeGenerator(config=SchedulerConfig(max_running_requests=1))
    engine = EngineProcess(EngineProcessConfig(args, "", "", 1), FakeChannel(), generator=generator)
    engine._handle(job("low"))
    engine._handle(GenerateJob("high", SamplingParams(prompt="p"), priority=10))
    engine.run_until_idle()
    assert [m.request_id for m in engine.channel.of(JobStarted)] == ["high", "low"]


def test_cancel_while_waiting_answers_at_once(engine) -> None:
    engine._handle(job("r1"))
    engine._handle(job("r2"))
    engine._handle(CancelJob("r2"))
    assert [m.request_id for m in engine.channel.of(JobCancelled)] == ["r2"]
    engine.run_until_idle()
    assert engine.scheduler.num_waiting == 0
    assert not engine.channel.of(JobStarted, "r2")


def test_cancel_while_running_stops_at_the_next_step(engine) -> None:
    cancel = {"r1"}
    engine.generator.pipeline.on_step = lambda req: (
        engine._handle(CancelJob(req.request_id))
        if req.step_index == 1 and req.request_id in cancel
        else None
    )
    engine._handle(job("r1", num_inference_steps=50))
    engine._handle(job("r2", num_inference_steps=3))
    engine.run_until_idle()
    [cancelled] = engine.channel.of(JobCancelled, "r1")
    assert cancelled.at_step == 1
    [finished] = engine.channel.of(JobFinished)  # its batch-mate carries on
    assert finished.request_id == "r2" and finished.batch_sizes == [2, 1, 1]


def test_url_responses_are_written_to_the_output_dir(engine, tmp_path) -> None:
    engine._handle(job("0" * 32, response_format="url", output_format="webp", output_compression=50))
    engine.run_until_idle()
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
