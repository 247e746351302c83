"""Launching a real `diffserve serve` process on a free port, for every server test module: forked from the
preloaded fork server (`diffserve.testing.preloaded`), its engine and ranks forked from it in turn, so a
start costs a fraction of a second of imports instead of about five.

A plain module (not conftest.py) so test files can import `start_server` by name."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from diffserve.cli.main import main as cli_main
from diffserve.testing.ports import unassigned_port
from diffserve.testing.preloaded import PreloadedCommand, start_logged_command

if TYPE_CHECKING:
    import openai

API_KEY = "test-key-123"
MODEL_NAME = "tiny-flux"
STARTUP_TIMEOUT_S = 180


@dataclass
class ServerProcess:
    process: PreloadedCommand
    base_url: str
    port: int
    output_dir: Path
    log_path: Path
    api_key: str | None = None
    model_name: str | None = None
    #: /health statuses seen while waiting for the server to become ready.
    startup_health: list[tuple[int, dict]] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai_client(self, timeout: float = 60) -> openai.OpenAI:
        """The `openai` SDK's client of this server (its API key, else any), without retries."""
        import openai

        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=timeout
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def info(self) -> dict:
        return httpx.get(f"{self.base_url}/server_info", headers=self.headers, timeout=10).json()

    def wait_for(self, predicate, timeout: float = 30, interval: float = 0.1, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        log = "\n".join(line for line in self.log().splitlines() if "GET /server_info" not in line)
        what = what() if callable(what) else what
        raise AssertionError(
            f"timed out after {timeout} s waiting for {what}\n--- server log tail ---\n" + log[-6000:]
        )

    def stop(self, timeout: float = 30) -> None:
        """Terminate the server (it drains and exits), killing it if it has not exited after `timeout`."""
        if self.process.poll() is None:
            self.process.stop(timeout)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}\n{self.log()[-4000:]}")
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=5)
            except httpx.TransportError:
                return False
            self.startup_health.append((r.status_code, r.json()))
            return r.status_code == 200

        self.wait_for(ready, timeout, interval=0.1, what="/health 200")


def start_server(
    model_dir: Path, work_dir: Path, *extra: str, output_dir: Path | None = None, api_key: str | None = None
) -> ServerProcess:
    """`output_dir`: default `work_dir/outputs`; pass another server's to restart on its files. `api_key`:
    the server's `--api-key`, which the returned process's `headers` then send."""
    port = unassigned_port()
    if api_key is not None:
        extra = (*extra, "--api-key", api_key)
    output_dir = output_dir or work_dir / "outputs"
    log_path = work_dir / "server.log"
    argv = [
        "serve",
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        "--output-path",
        str(output_dir),
        *extra,
    ]
    # One torch thread: the test machine is small and shared; results do not depend on the thread count.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log_path.write_text("")
    process = start_logged_command(cli_main, argv, env=env, log_path=log_path)
    return ServerProcess(process, f"http://127.0.0.1:{port}", port, output_dir, log_path, api_key=api_key)


@contextmanager
def serving(model_dir: Path, work_dir: Path, *extra: str, **kwargs: Any) -> Iterator[ServerProcess]:
    """`start_server(...)` ready to serve (/health 200), stopped on leaving (`ServerProcess.stop`): the body
    of a module-scoped server fixture."""
    srv = start_server(model_dir, work_dir, *extra, **kwargs)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def generate_pixels(srv: ServerProcess, body: dict[str, Any], timeout: float = 120) -> list[Any]:
    """POST /v1/images/generations (32x32 unless `body` sets a size), 200 asserted: each image's RGB pixels
    as an int array (numpy and PIL are imported here, not by every importer)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    r = httpx.post(f"{srv.base_url}/v1/images/generations", json={"size": "32x32", **body}, timeout=timeout)
    assert r.status_code == 200, r.text
    out = []
    for item in r.json()["data"]:
        with Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) as image:
            out.append(np.asarray(image.convert("RGB")).astype(int))
    return out
