"""Issue 31 item 11: a wedged engine is noticed and restarted (`--engine-watchdog-seconds`).

The front end's watchdog reads the engine's heartbeat (engine_liveness.py): a step, message or
admission lasting the limit, or that long without a heartbeat, gets the engine process killed and
restarted through the usual path. Meanwhile /health answers 503 `engine_wedged` naming why, the request
in flight gets 503 `engine_died`, and /health_generate answers instead of waiting for the stuck engine.
The server test freezes the engine process (SIGSTOP: no step, no message, no heartbeat); the watchdog's
decision for a heartbeat that reports a stuck step is checked on the engine client directly."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import pytest
from server_process import start_server

from diffserve.configs.engine_args import EngineArgs
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient, EngineState
from diffserve.server.metrics import ServerMetrics

LIMIT_S = 3


def health(srv) -> tuple[int, dict]:
    r = httpx.get(f"{srv.base_url}/health", timeout=5)
    return r.status_code, r.json()


def test_a_frozen_engine_is_reported_and_restarted_within_the_limit(tiny_flux_dir, tmp_path) -> None:
    srv = start_server(
        tiny_flux_dir, tmp_path, "--no-warmup", "--engine-watchdog-seconds", str(LIMIT_S),
        "--max-inference-steps", "100000",
    )  # fmt: skip
    frozen: int | None = None
    try:
        srv.wait_ready()
        pid = srv.info()["engine"]["pid"]
        body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 100000}
        answer: dict = {}

        def long_request() -> None:
            r = httpx.post(f"{srv.base_url}/v1/images/generations", json=body, timeout=60)
            answer.update(status=r.status_code, body=r.json())

        thread = threading.Thread(target=long_request)
        thread.start()
        srv.wait_for(lambda: srv.info()["engine"]["running"] == 1, 30, what="the long request running")
        os.kill(pid, signal.SIGSTOP)  # no step, no message, no heartbeat from now on
        frozen, start = pid, time.monotonic()

        status, error = srv.wait_for(
            lambda: (h := health(srv))[0] == 503 and h, LIMIT_S + 10, what="/health 503 for the wedge"
        )
        noticed = time.monotonic() - start
        assert LIMIT_S - 0.5 <= noticed <= LIMIT_S + 5, noticed
        assert error["error"]["code"] == "engine_wedged"
        assert "no heartbeat from its process" in error["error"]["message"]
        assert f"--engine-watchdog-seconds {LIMIT_S}" in error["error"]["message"]
        probe = httpx.get(f"{srv.base_url}/health_generate", timeout=10)  # answers: it does not wait
        assert probe.status_code == 503

        thread.join(30)
        assert answer["status"] == 503 and answer["body"]["error"]["code"] == "engine_died", answer
        assert "was killed because it was stuck" in answer["body"]["error"]["message"]
        assert "is stuck: no heartbeat from its process" in srv.log()

        srv.wait_for(lambda: health(srv)[0] == 200, 120, what="the restarted engine to be ready")
        info = srv.info()["engine"]
        assert info["restarts"] == 1 and info["pid"] != pid
        assert httpx.get(f"{srv.base_url}/health_generate", timeout=60).status_code == 200
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):  # the watchdog killed it, as it should
                os.kill(frozen, signal.SIGKILL)
        srv.stop()


@pytest.fixture
def client(tmp_path) -> EngineClient:
    args = ServerArgs(
        EngineArgs(model_path="/fake/model", output_path=str(tmp_path)), engine_watchdog_seconds=10
    )
    engine = EngineClient(args, ServerMetrics(), on_fatal=lambda code, message: None)
    engine.state = EngineState.READY
    return engine


def test_a_heartbeat_reporting_a_stuck_step_counts_as_a_wedge(client) -> None:
    doing = "one step of the engine loop (2 running, 1 waiting)"
    client._heartbeat, client._heard_at = msg.EngineHeartbeat(9.0, doing), time.monotonic() - 0.5
    assert client._wedged() is None  # 9.5 s: within the limit
    client._heartbeat = msg.EngineHeartbeat(9.8, doing)
    client._heard_at = time.monotonic() - 0.5
    assert client._wedged() == f"{doing} has lasted 10 s, over --engine-watchdog-seconds 10"


def test_an_engine_making_progress_or_not_watched_is_left_alone(client) -> None:
    client._heartbeat, client._heard_at = msg.EngineHeartbeat(0.2, "the engine loop, idle"), time.monotonic()
    assert client._wedged() is None
    client._heard_at = time.monotonic() - 60  # silent, but ...
    for state in (EngineState.STARTING, EngineState.RESTARTING, EngineState.STOPPING):
        client.state = state  # ... loading, restarting or draining: not watched
        assert client._wedged() is None
    client.state = EngineState.READY
    assert "no heartbeat from its process for 60 s" in (client._wedged() or "")
    client.args.engine_watchdog_seconds = 0  # off
    assert client._wedged() is None
