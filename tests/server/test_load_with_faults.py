"""Issue 17: load with faults, short. 120 requests at concurrency 8 (normal, SSE, client-disconnected and
invalid, mixed) with one SIGKILL of the engine midway, through benchmarks/load_with_faults.py: every
request answered (2xx, 4xx or an OpenAI-shaped 503 during the restart; no 500, no hang), healthy again
within 30 s, the front end's RSS after the run within a bound of its RSS after warm-up."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from load_with_faults import LoadConfig, run_load  # noqa: E402

API_KEY = "load-key-0123"


@pytest.fixture(scope="module")
def srv(tiny_flux_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_flux_dir, tmp_path_factory.mktemp("load"), "--api-key", API_KEY,
        "--max-queue-size", "32", "--max-inference-steps", "2", "--no-warmup",
    )  # fmt: skip
    server.api_key = API_KEY
    try:
        server.wait_ready()
        yield server
    finally:
        server.process.terminate()
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()


def test_load_with_an_engine_kill(srv: ServerProcess) -> None:
    config = LoadConfig(
        srv.base_url, API_KEY, num_requests=120, concurrency=8, kill_at=0.5, warmup_requests=16
    )
    report = asyncio.run(run_load(config))
    print(report.to_dict()["outcomes"], report.seconds_to_healthy)
    assert report.problems(config) == [], report.to_dict()
    assert sum(report.outcomes.values()) == 120
    assert report.killed_pid is not None and srv.info()["engine"]["pid"] != report.killed_pid
    assert report.by_kind["invalid"] == {"400": 30}, report.by_kind
    # the kill happened with work in flight, and the server served again after it
    assert report.outcomes["200"] > 0
    assert srv.process.poll() is None
