"""Issue 31 item 11: one request must not wedge the engine process. Its threads run here in-process with
a stand-in pipeline, fed through a queue as ZeroMQ feeds them: a job whose admission (validation, memory
fitting) is slow is admitted off the receiver thread, so a cancel and /health_generate's probe of other
requests are still taken meanwhile; jobs keep their arrival order; and the heartbeat names a step that
never ends, for the front end's watchdog (test_engine_watchdog.py restarts such an engine)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.runtime import SchedulerConfig
from diffserve.server import protocol as msg
from diffserve.server.engine_process import EngineProcess, EngineProcessConfig
from diffserve.testing.fake_pipeline import FakeGenerator

#: Seconds a test waits for an answer that comes at once when nothing blocks it.
ANSWER_TIMEOUT_S = 10.0


class QueueChannel:
    """The engine's end of the link: jobs in through a queue (`put`), messages out into a list."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.sent: list[Any] = []
        self._cond = threading.Condition()

    def put(self, message: Any) -> None:
        self.inbox.put(message)

    def recv(self, timeout_ms: int) -> Any | None:
        try:
            return self.inbox.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return None

    def send(self, message: Any) -> None:
        with self._cond:
            self.sent.append(message)
            self._cond.notify_all()

    def of(self, kind: type, request_id: str | None = None) -> list[Any]:
        with self._cond:
            found = [m for m in self.sent if isinstance(m, kind)]
        return found if request_id is None else [m for m in found if m.request_id == request_id]

    def wait_for(self, kind: type, request_id: str | None = None, timeout: float = ANSWER_TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (found := self.of(kind, request_id)):
                left = deadline - time.monotonic()
                if left <= 0:
                    sent = [type(m).__name__ for m in self.sent if not isinstance(m, msg.JobProgress)]
                    raise AssertionError(
                        f"no {kind.__name__} for {request_id!r} in {timeout:g} s; sent: {sent}"
                    )
                self._cond.wait(left)
        return found[0]


class RunningEngine:
    """An `EngineProcess` with its loop, receiver and heartbeat threads running, as `run_engine_process`
    runs them after its warm-up."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine, self.channel = engine, engine.channel
        engine.receiver = threading.Thread(target=engine._receive_loop, name="engine-receiver", daemon=True)
        self.loop = threading.Thread(target=engine.run_forever, name="engine-loop", daemon=True)
        self.heartbeat = threading.Thread(target=engine._heartbeat_loop, name="engine-heartbeat", daemon=True)

    def __enter__(self) -> RunningEngine:
        for thread in (self.engine.receiver, self.loop, self.heartbeat):
            thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.channel.put(msg.ShutdownEngine())
        self.loop.join(ANSWER_TIMEOUT_S)
        assert kind is not None or not self.loop.is_alive(), "the engine loop did not stop"


def job(rid: str, steps: int = 1, **kwargs: Any) -> msg.GenerateJob:
    return msg.GenerateJob(rid, SamplingParams(prompt=rid, num_inference_steps=steps), **kwargs)


@pytest.fixture
def make_engine(tmp_path) -> Iterator[Callable[..., RunningEngine]]:
    """An engine whose steps take `step_s` seconds each (the stand-in pipeline's are instant)."""
    made: list[RunningEngine] = []

    def make(step_s: float = 0.01, max_running: int = 8) -> RunningEngine:
        args = EngineArgs(
            model_path="/fake/model", output_path=str(tmp_path), max_running_requests=max_running
        )
        generator = FakeGenerator(config=SchedulerConfig(max_running_requests=max_running))
        generator.pipeline.on_step = lambda req: time.sleep(step_s)
        engine = EngineProcess(EngineProcessConfig(args, "", "", 1), QueueChannel(), generator=generator)
        made.append(RunningEngine(engine))
        return made[-1]

    yield make


def slow_admission(engine: EngineProcess, request_id: str) -> threading.Event:
    """Make `request_id`'s admission (`Engine.prepare`: validation and the memory model's fitting) block
    until the returned event is set: a slow fitter, as a huge or hostile request can make it."""
    release = threading.Event()
    prepare = engine.engine.prepare

    def slow_prepare(req, *args, **kwargs):
        if req.request_id == request_id:
            assert release.wait(60), "the slow admission was never released"
        return prepare(req, *args, **kwargs)

    engine.engine.prepare = slow_prepare  # type: ignore[method-assign]
    return release


def test_a_slow_admission_holds_neither_a_cancel_nor_a_health_probe(make_engine) -> None:
    """Before, the receiver admitted each job itself: while one was admitted no cancel, LoRA op, probe
    or other job was even read."""
    running = make_engine(step_s=0.02)
    engine, channel = running.engine, running.channel
    release = slow_admission(engine, "slow")
    with running:
        channel.put(job("long", steps=1000))  # 20 s of steps
        channel.wait_for(msg.JobStarted, "long")
        channel.put(job("slow"))
        channel.put(msg.CancelJob("long"))
        assert channel.wait_for(msg.JobCancelled, "long").at_step is not None  # cancelled while running
        channel.put(job("probe", internal=True))  # /health_generate's generation
        channel.wait_for(msg.JobFinished, "probe")
        stall = engine.liveness.longest()
        assert stall.doing == "admitting request slow" and stall.seconds > 0
        # Cancelled while still being admitted: answered once its admission ends, never started.
        channel.put(msg.CancelJob("slow"))
        time.sleep(0.2)  # the receiver marks it
        release.set()
        assert channel.wait_for(msg.JobCancelled, "slow").at_step is None
        assert not channel.of(msg.JobStarted, "slow") and not channel.of(msg.JobFinished, "slow")
        assert engine.liveness.longest().doing != "admitting request slow"


def test_jobs_keep_their_arrival_order_when_one_is_admitted_slowly(make_engine) -> None:
    """One job at a time: `first` arrives before `second` but is admitted after it; both wait behind a
    running job, and `first` still starts first (its arrival number was taken when it was received)."""
    running = make_engine(step_s=0.02, max_running=1)
    engine, channel = running.engine, running.channel
    release = slow_admission(engine, "first")
    with running:
        channel.put(job("busy", steps=100))  # 2 s
        channel.wait_for(msg.JobStarted, "busy")
        channel.put(job("first", ack=True))
        channel.put(job("second", ack=True))
        channel.wait_for(msg.JobAccepted, "second")
        release.set()
        channel.wait_for(msg.JobAccepted, "first")
        channel.wait_for(msg.JobFinished, "second")
    assert [m.request_id for m in channel.of(msg.JobStarted)] == ["busy", "first", "second"]


def test_a_rejected_job_is_answered_from_its_admission_thread(make_engine) -> None:
    running = make_engine()
    with running:
        running.channel.put(msg.GenerateJob("bad", SamplingParams(prompt="p", width=40)))
        rejected = running.channel.wait_for(msg.JobRejected, "bad")
    assert rejected.param == "width"


def test_shutdown_answers_the_jobs_still_being_admitted(make_engine) -> None:
    running = make_engine()
    release = slow_admission(running.engine, "slow")
    with running:
        running.channel.put(job("slow"))
        time.sleep(0.3)  # its admission has begun
        running.channel.put(msg.ShutdownEngine())
        time.sleep(0.3)
        release.set()
    assert running.channel.wait_for(msg.JobCancelled, "slow").at_step is None


def test_the_heartbeat_names_a_step_that_does_not_end(make_engine) -> None:
    """A step stuck (a hung collective, a driver call that never returns) keeps the heartbeat going, and
    it reports how long that step has lasted: what the front end's watchdog restarts the engine for."""
    running = make_engine()
    engine, channel = running.engine, running.channel
    stuck = threading.Event()
    engine.generator.pipeline.on_step = lambda req: stuck.wait(30) if req.request_id == "stuck" else None
    with running:
        channel.put(job("stuck", steps=2))
        channel.wait_for(msg.JobStarted, "stuck")
        time.sleep(2.5)
        beats = channel.of(msg.EngineHeartbeat)
        stuck.set()
        channel.wait_for(msg.JobFinished, "stuck")
        time.sleep(1.5)  # the next heartbeat
        after = channel.of(msg.EngineHeartbeat)[-1]
    assert len(beats) >= 2
    assert beats[-1].doing == "one step of the engine loop (1 running, 0 waiting)"
    assert 1.0 <= beats[-1].stalled_seconds <= 3.5
    assert after.stalled_seconds < 1.0  # an engine making progress: idle turns are short
