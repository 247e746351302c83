"""Issue 31 item 3, end to end: a real `diffserve serve` on a tiny Wan checkpoint decodes a long video (1025
frames, 96x64, 1 step: minutes of VAE decode on this machine) in chunks, a latent frame at a time.

While it decodes, a short job submitted behind it runs its steps and its own decode between the long
decode's chunks and completes first; a DELETE during the decode answers at once (the decode stops at
its next chunk, not 30 s later), the job is `cancelled` in its status and the log says it was cancelled
while decoding (not "completed ... 1 video(s)")."""

from __future__ import annotations

import time

import httpx
import pytest
from server_process import serving

LONG = {"prompt": "a fox", "num_frames": 1025, "size": "96x64", "num_inference_steps": 1}
SHORT = {"prompt": "a cat", "num_frames": 5, "size": "32x32", "num_inference_steps": 1}
#: The DELETE's bound: one latent frame's decode (a fraction of a second), with room for a loaded machine.
DELETE_WITHIN_S = 3.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    model_dir = build_tiny_wan(tmp_path_factory.mktemp("tiny-wan-decode"), TinyWanSpec())
    with serving(model_dir, tmp_path_factory.mktemp("decode-chunks"), "--no-warmup") as srv:
        yield srv


def create(srv, body: dict) -> str:
    r = httpx.post(f"{srv.base_url}/v1/videos", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def job(srv, video_id: str) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/videos/{video_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_long_decode_runs_beside_other_jobs_and_a_delete_stops_it_at_once(server) -> None:
    long_id = create(server, LONG)
    server.wait_for(lambda: job(server, long_id)["phase"] == "decoding", 120, what="the long video decoding")
    decoding_since = time.monotonic()

    short_id = create(server, SHORT)  # behind the long decode: its steps and decode run between its chunks
    server.wait_for(
        lambda: job(server, short_id)["status"] == "completed", 60, what="the short job completed"
    )
    short_done = time.monotonic() - decoding_since
    still = job(server, long_id)
    assert still["status"] == "in_progress" and still["phase"] == "decoding", (short_done, still)

    start = time.monotonic()
    r = httpx.delete(f"{server.base_url}/v1/videos/{long_id}", timeout=60)
    answered = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert answered < DELETE_WITHIN_S, f"DELETE answered after {answered:.1f} s"
    assert job(server, long_id)["status"] == "cancelled"

    def finish_line() -> str | None:
        lines = [
            line for line in server.log().splitlines() if f"Request {long_id} " in line and " in " in line
        ]
        return next((line for line in lines if "cancelled" in line or "completed" in line), None)

    line = server.wait_for(finish_line, 10, what="the long job's finish line")
    assert f"Request {long_id} cancelled while decoding in " in line, line
    assert f"Video job {long_id} completed" not in server.log()

    # The engine is free at once: another job runs to the end.
    again = create(server, SHORT)
    server.wait_for(lambda: job(server, again)["status"] == "completed", 60, what="a job after the cancel")
