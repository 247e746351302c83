"""`diffserve serve --num-gpus 2` (Ulysses 2 on the CPU: two rank processes over gloo): the openai SDK
gets the same image as from a one-rank server, and a rank process that dies makes the engine exit, so
the front end answers 503 and restarts it with new ranks, instead of hanging in a collective. Ctrl-C
then stops every rank in order: no gloo "Connection closed by peer ... GLHF!" (issue 31 item 8)."""

from __future__ import annotations

import base64
import io
import os
import signal
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
from PIL import Image
from server_process import start_server

BODY = dict(prompt="a red fox", size="64x64", extra_body={"seed": 3, "num_inference_steps": 3})
#: What gloo prints when a peer's sockets close under a collective, and what a dying rank prints.
NOISE = ("GLHF", "Connection closed by peer", "Connection reset by peer", "Traceback")


def pixels(result) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))), dtype=np.int16)


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def stop(srv) -> None:
    if srv.process.poll() is None:
        srv.process.send_signal(signal.SIGTERM)
        srv.process.wait(60)


@pytest.fixture(scope="module")
def one_rank_pixels(tiny_flux_dir, tmp_path_factory) -> np.ndarray:
    srv = start_server(tiny_flux_dir, tmp_path_factory.mktemp("one-rank"), "--no-warmup")
    try:
        srv.wait_ready()
        return pixels(client(srv).images.generate(**BODY))
    finally:
        stop(srv)


def test_two_ranks_serve_the_same_image_and_a_dead_rank_restarts_the_engine(
    tiny_flux_dir, tmp_path, one_rank_pixels
) -> None:
    srv = start_server(tiny_flux_dir, tmp_path, "--num-gpus", "2")
    try:
        srv.wait_ready()
        parallel = srv.info()["engine"]["parallel"]
        assert (parallel["num_gpus"], parallel["ulysses_degree"], len(parallel["worker_pids"])) == (2, 2, 1)
        assert np.abs(pixels(client(srv).images.generate(**BODY)) - one_rank_pixels).max() <= 1

        engine_pid = srv.info()["engine"]["pid"]
        os.kill(parallel["worker_pids"][0], signal.SIGKILL)
        # The engine notices, exits, and is restarted: /health says so meanwhile (503), then 200 again.
        srv.wait_for(lambda: srv.info()["engine"]["pid"] not in (None, engine_pid), 60, what="a new engine")
        srv.wait_for(lambda: httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200, 180,
                     what="the restarted engine to be ready")  # fmt: skip
        info = srv.info()["engine"]
        new_workers = info["parallel"]["worker_pids"]
        assert info["restarts"] == 1 and len(new_workers) == 1 and new_workers != parallel["worker_pids"]
        assert np.abs(pixels(client(srv).images.generate(**BODY)) - one_rank_pixels).max() <= 1

        # Ctrl-C as a terminal sends it: SIGINT to every process of the server (front end, engine, rank).
        before = len(srv.log())
        front_end = psutil.Process(srv.process.pid)
        for process in (front_end, *front_end.children(recursive=True)):
            process.send_signal(signal.SIGINT)
        assert srv.process.wait(60) == 130
        after = srv.log()[before:]
        assert "Engine stopped" in after and not [noise for noise in NOISE if noise in after], after
    finally:
        stop(srv)
    time.sleep(1)
    for pid in new_workers:  # no rank process outlives the server
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
