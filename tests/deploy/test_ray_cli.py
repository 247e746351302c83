"""`diffserve serve --ray` (issue 32): the command starts a local Ray instance, serves the shipped demo
model through Ray Serve at --host/--port (the `openai` SDK gets an image), and SIGTERM stops it all: the
command exits 0 and leaves no Ray process behind."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from diffserve.testing.ports import unassigned_port

pytest.importorskip("ray", reason='the Ray Serve tests need the extra: pip install "diffserve[ray]"')
openai = pytest.importorskip("openai")

STARTUP_TIMEOUT_S = 240


def test_serve_ray_serves_and_stops_on_sigterm(tmp_path) -> None:
    port = unassigned_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "diffserve.cli.main", "serve", "--ray", "--num-replicas", "1",
               "--port", str(port), "--output-path", str(tmp_path / "out"), "--log-level", "warning"]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"not ready in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        image = client.images.generate(
            prompt="a red circle", size="64x64", extra_body={"seed": 1, "num_inference_steps": 2}
        )
        assert base64.b64decode(image.data[0].b64_json)[:4] == b"\x89PNG"
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        assert ray_processes, "the local Ray instance runs under the command"
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == 0, log.read_text()[-4000:]
        _, alive = psutil.wait_procs(ray_processes, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
