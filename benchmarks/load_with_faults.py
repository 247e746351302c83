"""Load with faults (issue 17): N requests at concurrency C, mixing normal, streamed (SSE), client-disconnected
and invalid requests, with a SIGKILL of the engine process midway.

    # start `diffserve serve` on a model folder, run, stop it
    python benchmarks/load_with_faults.py --launch MODEL_DIR --num-requests 1000 --concurrency 16
    # a server that is already running on this host (the engine's pid comes from /server_info)
    python benchmarks/load_with_faults.py --base-url http://127.0.0.1:30000 --api-key KEY

Reports every request's outcome (`200`, `400`, `503`, `200-stream-error`, `disconnected`, `transport-error`,
`timeout`, ...), the front end's and the engine's RSS over time, and how long the server took to answer
/health 200 again after the kill. Passes (exit 0) when every request got an HTTP answer that is a 2xx, a
4xx or an OpenAI-shaped 503, the server is healthy again within --healthy-within seconds, and the front
end's RSS after the run is within --rss-bound-mib of its RSS after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

KINDS = ("normal", "stream", "disconnect", "invalid")
REQUEST_TIMEOUT_S = 120.0
#: Outcomes a request may end with and still count as answered (the client left: `disconnected`).
GOOD = {"disconnected"}


@dataclass
class LoadConfig:
    base_url: str
    api_key: str | None = None
    num_requests: int = 1000
    concurrency: int = 16
    kill_at: float = 0.5  # fraction of the requests sent before the engine is killed; < 0: no kill
    size: str = "16x16"
    steps: int = 1
    warmup_requests: int = 16
    healthy_within_s: float = 30.0
    rss_bound_mib: float = 64.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class LoadReport:
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    bad: list[str] = field(default_factory=list)  # every request that failed the contract, and why
    rss_samples: list[tuple[float, int, int]] = field(default_factory=list)  # (s, front RSS, engine RSS)
    front_rss_after_warmup: int = 0
    front_rss_after_run: int = 0
    killed_pid: int | None = None
    seconds_to_healthy: float | None = None
    seconds: float = 0.0

    def passed(self, config: LoadConfig) -> bool:
        return not self.problems(config)

    def problems(self, config: LoadConfig) -> list[str]:
        out = list(self.bad[:20])
        answered = sum(self.outcomes.values())
        if answered != config.num_requests:
            out.append(f"{answered} outcomes for {config.num_requests} requests")
        if config.kill_at >= 0 and (
            self.seconds_to_healthy is None or self.seconds_to_healthy > config.healthy_within_s
        ):
            out.append(
                f"not healthy within {config.healthy_within_s:g} s of the kill ({self.seconds_to_healthy})"
            )
        growth = self.front_rss_after_run - self.front_rss_after_warmup
        if growth > config.rss_bound_mib * 2**20:
            out.append(f"front-end RSS grew {growth / 2**20:.0f} MiB (bound {config.rss_bound_mib:g} MiB)")
        return out

    def to_dict(self) -> dict:
        return {
            "outcomes": dict(self.outcomes),
            "by_kind": {k: dict(v) for k, v in self.by_kind.items()},
            "bad": self.bad[:50],
            "front_rss_after_warmup_mib": round(self.front_rss_after_warmup / 2**20, 1),
            "front_rss_after_run_mib": round(self.front_rss_after_run / 2**20, 1),
            "killed_engine_pid": self.killed_pid,
            "seconds_to_healthy": self.seconds_to_healthy,
            "seconds": round(self.seconds, 2),
            "rss_samples_mib": [
                (round(t, 1), round(f / 2**20), round(e / 2**20)) for t, f, e in self.rss_samples
            ],
        }


def body_of(kind: str, index: int, config: LoadConfig) -> dict:
    if kind == "invalid":
        return {"prompt": "x", "size": "banana", "num_inference_steps": config.steps}
    body = {
        "prompt": f"request {index}",
        "size": config.size,
        "num_inference_steps": config.steps,
        "seed": index,
    }
    return {**body, "stream": True} if kind == "stream" else body


def is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def judge(kind: str, response: httpx.Response) -> tuple[str, str | None]:
    """(outcome label, why it breaks the contract or None)."""
    status = response.status_code
    if kind == "stream" and status == 200:
        text = response.text
        if "event: error" in text:
            return "200-stream-error", None  # the engine died mid-stream: reported in the stream
        if "image_generation.completed" not in text:
            return "200-stream-truncated", "a stream ended without a completed or error event"
        return "200", None
    if status == 200 or 400 <= status < 500 and status != 499:
        if status >= 400 and not is_openai_error(response):
            return str(status), f"{status} without OpenAI's error shape: {response.text[:200]}"
        if kind == "invalid" and status != 400:
            return str(status), f"an invalid request got {status}"
        return str(status), None
    if status == 503 and is_openai_error(response):
        return "503", None
    return str(status), f"{status}: {response.text[:200]}"


async def disconnecting_request(config: LoadConfig, index: int) -> str:
    """Send a generation and leave before its answer (the server must cancel it and carry on)."""
    url = urlsplit(config.base_url)
    data = json.dumps(body_of("normal", index, config)).encode()
    auth = f"Authorization: Bearer {config.api_key}\r\n" if config.api_key else ""
    head = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: {url.hostname}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(head.encode() + data)
    await writer.drain()
    await asyncio.sleep(0.02)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return "disconnected"


async def one_request(
    client: httpx.AsyncClient, config: LoadConfig, kind: str, index: int
) -> tuple[str, str | None]:
    try:
        if kind == "disconnect":
            return await disconnecting_request(config, index), None
        response = await client.post("/v1/images/generations", json=body_of(kind, index, config))
        return judge(kind, response)
    except httpx.TimeoutException:
        return "timeout", f"no answer in {REQUEST_TIMEOUT_S:g} s"
    except (httpx.TransportError, OSError) as exc:
        return "transport-error", f"{type(exc).__name__}: {exc}"


def server_info(config: LoadConfig) -> dict:
    return httpx.get(f"{config.base_url}/server_info", headers=config.headers, timeout=10).json()


def rss(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


class RssSampler:
    """Samples the front end's and the current engine's RSS every `interval` s in a thread."""

    def __init__(self, config: LoadConfig, front_pid: int, report: LoadReport, interval: float = 0.5) -> None:
        self.config, self.front_pid, self.report, self.interval = config, front_pid, report, interval
        self.engine_pid: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            sample = (time.monotonic() - self._start, rss(self.front_pid), rss(self.engine_pid))
            self.report.rss_samples.append(sample)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


async def wait_healthy(config: LoadConfig, since: float, old_pid: int | None) -> float | None:
    """Seconds from `since` until /health is 200 on an engine other than `old_pid` (None: not in time)."""
    deadline = since + max(config.healthy_within_s * 4, 120)
    async with httpx.AsyncClient(base_url=config.base_url, headers=config.headers, timeout=5) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                health = await client.get("/health")
                if health.status_code == 200:
                    pid = (await client.get("/server_info")).json()["engine"]["pid"]
                    if pid != old_pid:
                        return time.monotonic() - since
            await asyncio.sleep(0.1)
    return None


async def run_load(config: LoadConfig) -> LoadReport:
    report = LoadReport()
    info = server_info(config)
    front_pid, engine_pid = info["front_end_pid"], info["engine"]["pid"]
    limits = httpx.Limits(max_connections=config.concurrency * 2)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(
        base_url=config.base_url, headers=config.headers, timeout=timeout, limits=limits
    ) as client:
        warm = [one_request(client, config, KINDS[i % len(KINDS)], i) for i in range(config.warmup_requests)]
        await asyncio.gather(*warm)
        report.front_rss_after_warmup = rss(front_pid)
        kill_index = int(config.num_requests * config.kill_at) if config.kill_at >= 0 else -1
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(config.num_requests):
            queue.put_nowait(i)
        healthy_task: asyncio.Task | None = None
        start = time.monotonic()

        with RssSampler(config, front_pid, report) as sampler:
            sampler.engine_pid = engine_pid

            async def worker() -> None:
                nonlocal healthy_task
                while not queue.empty():
                    index = queue.get_nowait()
                    if index == kill_index:
                        os.kill(engine_pid, signal.SIGKILL)
                        report.killed_pid = engine_pid
                        healthy_task = asyncio.create_task(wait_healthy(config, time.monotonic(), engine_pid))
                    kind = KINDS[index % len(KINDS)]
                    outcome, problem = await one_request(client, config, kind, index)
                    report.outcomes[outcome] += 1
                    report.by_kind[kind][outcome] += 1
                    if problem is not None:
                        report.bad.append(f"#{index} {kind}: {problem}")

            await asyncio.gather(*(worker() for _ in range(config.concurrency)))
            if healthy_task is not None:
                report.seconds_to_healthy = await healthy_task
                with contextlib.suppress(Exception):
                    sampler.engine_pid = server_info(config)["engine"]["pid"]
            report.seconds = time.monotonic() - start
            await asyncio.sleep(1.0)  # let the front end drop the finished requests' buffers
    report.front_rss_after_run = rss(front_pid)
    return report


@contextlib.contextmanager
def launched_server(model_dir: str, api_key: str, extra: list[str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """`diffserve serve` on a free port for the run; yields its URL once /health is 200."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="load-with-faults-")
    cmd = [sys.executable, "-m", "diffserve.cli.main", "serve", "--model-path", model_dir, "--port", str(port),
           "--api-key", api_key, "--output-path", out, *extra]  # fmt: skip
    log = open(Path(out) / "server.log", "w")  # noqa: SIM115 (open for the server's lifetime)
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; see {log.name}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the server was not healthy within 300 s; see {log.name}")
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server on this host")
    where.add_argument("--launch", metavar="MODEL_DIR", help="start `diffserve serve` on this model folder")
    parser.add_argument("--api-key", default=os.environ.get("DIFFSERVE_API_KEY"))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kill-at", type=float, default=0.5, help="fraction sent before SIGKILL (<0: none)")
    parser.add_argument("--size", default="16x16")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--healthy-within", type=float, default=30.0)
    parser.add_argument("--rss-bound-mib", type=float, default=64.0)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1:
        parser.error("--num-requests and --concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def run(url: str, key: str | None) -> LoadReport:
        config = LoadConfig(
            url, key, args.num_requests, args.concurrency, args.kill_at, args.size, args.steps,
            healthy_within_s=args.healthy_within, rss_bound_mib=args.rss_bound_mib,
        )  # fmt: skip
        report = asyncio.run(run_load(config))
        print(json.dumps(report.to_dict(), indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
        problems = report.problems(config)
        print("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems))
        return 0 if not problems else 1

    if args.base_url:
        return run(args.base_url, args.api_key)
    key = args.api_key or "load-with-faults"
    with launched_server(args.launch, key, ["--max-queue-size", str(args.concurrency * 4)]) as (url, _):
        return run(url, key)


if __name__ == "__main__":
    sys.exit(main())
