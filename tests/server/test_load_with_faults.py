"""Issue 17: load with faults, short. 120 requests at concurrency 8 (normal, SSE, client-disconnected and
invalid, mixed) with one SIGKILL of the engine midway, through benchmarks/load_with_faults.py: every
request answered (2xx, 4xx or an OpenAI-shaped 503 during the restart; no 500, no hang), healthy again
within 30 s, the front end's RSS after the run within a bound of its RSS after warm-up. LoRA faults under
load (issue 31): a huge-header adapter POSTed and named while generations run stalls none of them, and an
adapter a queued request names cannot be deleted (409) until it has run."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess, serving

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from load_with_faults import LoadConfig, run_load  # noqa: E402

API_KEY = "load-key-0123"


@pytest.fixture(scope="module")
def srv(tiny_flux_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    with serving(
        tiny_flux_dir, tmp_path_factory.mktemp("load"),
        "--max-queue-size", "32", "--max-inference-steps", "2", "--no-warmup", api_key=API_KEY,
    ) as server:  # fmt: skip
        yield server


def test_load_with_an_engine_kill(srv: ServerProcess) -> None:
    # Healthy again within 120 s of the kill: the benchmark's 30 s target is for a quiet machine; a loaded one
    # (the suite's other worker) restarts an engine process several times slower.
    config = LoadConfig(
        srv.base_url, API_KEY, num_requests=120, concurrency=8, kill_at=0.5, warmup_requests=16,
        healthy_within_s=120.0,
    )  # fmt: skip
    report = asyncio.run(run_load(config))
    print(report.to_dict()["outcomes"], report.seconds_to_healthy)
    assert report.problems(config) == [], report.to_dict()
    assert sum(report.outcomes.values()) == 120
    assert report.killed_pid is not None and srv.info()["engine"]["pid"] != report.killed_pid
    assert report.by_kind["invalid"] == {"400": 30}, report.by_kind
    # the kill happened with work in flight, and the server served again after it
    assert report.outcomes["200"] > 0
    assert srv.process.poll() is None


def test_load_while_a_slow_header_flood_holds_connections(srv: ServerProcess) -> None:
    """Issue 31: 400 connections from one other address sending one header byte every 0.5 s (slowloris)
    while a load runs: the flood is held to the default per-client cap, every request of the load is
    answered as if it were not there, and the log does not grow a line per connection."""
    import socket
    import threading
    import time

    stop, flood, held = threading.Event(), [], []
    log_before = len(srv.log())

    def trickle() -> None:
        for _ in range(400):
            sock = socket.socket()
            sock.bind(("127.0.0.3", 0))
            sock.connect(("127.0.0.1", srv.port))
            sock.setblocking(False)
            flood.append(sock)
        byte, ended = 0, set()
        while not stop.wait(0.5):
            for n, sock in enumerate(flood):
                if n in ended:
                    continue
                try:
                    sock.recv(4096)  # an answer (503, 408) or the close: the server let it go
                    ended.add(n)
                    continue
                except BlockingIOError:
                    pass  # nothing: still held
                except OSError:
                    ended.add(n)
                    continue
                try:
                    sock.send(b"GET / HTTP/1.1\r\nX: "[byte % 19 : byte % 19 + 1])
                except OSError:
                    ended.add(n)
            held.append(len(flood) - len(ended))
            byte += 1

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        time.sleep(2)
        config = LoadConfig(
            srv.base_url, API_KEY, num_requests=40, concurrency=8, kill_at=-1, warmup_requests=4
        )
        report = asyncio.run(run_load(config))
    finally:
        stop.set()
        thread.join(30)
        for sock in flood:
            sock.close()
    assert report.problems(config) == [], report.to_dict()
    assert report.outcomes["200"] > 0 and report.outcomes.get("503", 0) == 0, report.to_dict()["outcomes"]
    assert held and 0 < max(held) <= 128, held  # the default --max-connections-per-client
    grown = srv.log()[log_before:]
    assert "Traceback" not in grown and grown.count("Connections:") <= 10, grown[-3000:]


# --- LoRA faults under load (issue 31 items 14 and 16) --------------------------------------------------


@pytest.fixture(scope="module")
def lora_srv(tiny_flux_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """One request runs at a time (the next ones queue), with a --lora-dir of good and hostile files."""
    from hostile_loras import serving_hostile_loras

    work = tmp_path_factory.mktemp("load-lora")
    limits = ("--max-running-requests", "1", "--max-inference-steps", "100000")
    with serving_hostile_loras(tiny_flux_dir, work, *limits, api_key=API_KEY) as server:
        yield server


def _post(srv: ServerProcess, path: str, body: dict, timeout: float = 120):
    import httpx

    return httpx.post(
        f"{srv.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=timeout
    )


IMAGE = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 4, "seed": 3}


def test_a_huge_lora_header_stalls_no_one(lora_srv: ServerProcess) -> None:
    """While the huge-header file is POSTed and named by requests (the issue: 48.6 s per try, every
    generation stalled meanwhile, on every request naming it), plain generations keep their pace and
    each try is refused at once."""
    import threading
    import time

    latencies: list[float] = []
    stop = threading.Event()

    def plain() -> None:
        while not stop.is_set():
            start = time.monotonic()
            r = _post(lora_srv, "/v1/images/generations", IMAGE)
            assert r.status_code == 200, r.text
            latencies.append(time.monotonic() - start)

    thread = threading.Thread(target=plain, daemon=True)
    thread.start()
    try:
        refusals = []
        for attempt in range(4):
            start = time.monotonic()
            if attempt % 2 == 0:
                r = _post(
                    lora_srv, "/v1/loras", {"name": f"huge{attempt}", "path": "huge-header.safetensors"}
                )
            else:
                r = _post(lora_srv, "/v1/images/generations", {**IMAGE, "loras": [{"name": "huge-header"}]})
            refusals.append(time.monotonic() - start)
            assert r.status_code == 400 and "MAX_LORA_HEADER_BYTES" in r.json()["error"]["message"], r.text
        time.sleep(1)
    finally:
        stop.set()
        thread.join(120)
    print(
        f"refused in {[round(t, 2) for t in refusals]} s; plain generations {[round(t, 2) for t in latencies]} s"
    )
    assert max(refusals) < 10, refusals
    assert latencies and max(latencies) < 15, latencies
    assert lora_srv.process.poll() is None


def test_a_queued_requests_adapter_cannot_be_deleted(lora_srv: ServerProcess) -> None:
    """DELETE /v1/loras/style answered 200 while a queued request named `style` (it then failed, or ran
    another file registered under that name). Now: 409 while it waits, and its image once it runs."""
    import threading

    import httpx

    assert _post(lora_srv, "/v1/loras", {"name": "style", "path": "style.safetensors"}).status_code == 200
    outcomes: dict[str, object] = {}

    def slow() -> None:  # holds the one running slot until the client gives up (the server cancels it)
        try:
            outcomes["slow"] = _post(
                lora_srv, "/v1/images/generations", {**IMAGE, "num_inference_steps": 100000}, timeout=8
            )
        except httpx.TimeoutException as exc:
            outcomes["slow"] = exc

    def queued() -> None:
        outcomes["queued"] = _post(
            lora_srv, "/v1/images/generations", {**IMAGE, "loras": [{"name": "style"}]}
        )

    def cards() -> dict[str, dict]:
        r = httpx.get(
            f"{lora_srv.base_url}/v1/loras", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        )
        return {card["name"]: card for card in r.json()["data"]}

    first = threading.Thread(target=slow)
    first.start()
    lora_srv.wait_for(
        lambda: lora_srv.info()["engine"]["running"] == 1, timeout=30, what="the slow request to run"
    )
    second = threading.Thread(target=queued)
    second.start()
    try:
        lora_srv.wait_for(
            lambda: lora_srv.info()["engine"]["waiting"] == 1, timeout=30, what="the request to queue"
        )
        r = httpx.delete(
            f"{lora_srv.base_url}/v1/loras/style", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        )
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "lora_in_use" and "1 queued" in error["message"], error
        assert cards()["style"]["queued"] == 1 and cards()["style"]["in_use"] == 1
        # Nor can the name be taken over by another file meanwhile.
        r = _post(lora_srv, "/v1/loras", {"name": "style", "path": "other.safetensors"})
        assert r.status_code == 409, r.text
    finally:
        first.join(60)
        second.join(120)
    assert isinstance(outcomes["slow"], httpx.TimeoutException), outcomes
    queued_answer = outcomes["queued"]
    assert isinstance(queued_answer, httpx.Response) and queued_answer.status_code == 200, queued_answer
    lora_srv.wait_for(lambda: cards()["style"]["in_use"] == 0, timeout=30, what="the adapter to be free")
    r = httpx.delete(
        f"{lora_srv.base_url}/v1/loras/style", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert r.status_code == 200, r.text
