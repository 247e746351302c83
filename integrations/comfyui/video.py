"""A `/v1/videos` job run to its end (create, poll, download) and its MP4 decoded into frames with PyAV.

PyAV is imported when a video is decoded, so the image nodes work in a ComfyUI without it."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from .client import DiffserveClient, DiffserveError

#: Seconds between two polls of a job.
POLL_INTERVAL_S = 0.5


def load_av() -> ModuleType:
    """PyAV, or an ImportError that says how to install it (the Video node checks before it starts a job)."""
    try:
        import av
    except ImportError:
        raise ImportError(
            "the diffserve Video node decodes the server's MP4 with PyAV: install it in ComfyUI's Python "
            "environment (pip install av)"
        ) from None
    return av


def decode_mp4(data: bytes) -> tuple[torch.Tensor, float]:
    """Every frame of an MP4 as F x H x W x 3 float32 in 0..1, and its frame rate."""
    av = load_av()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        fps = float(stream.average_rate) if stream.average_rate else 0.0
    if not frames:
        raise DiffserveError("the server's video has no frames")
    return torch.from_numpy(np.stack(frames).astype(np.float32) / 255.0), fps


def run_video_job(
    client: DiffserveClient,
    body: dict,
    timeout_s: float,
    check_interrupt: Callable[[], None],
    report_progress: Callable[[int], None],
) -> bytes:
    """The MP4 of a job created with `body`. Polls until it finishes; a job that fails raises its error,
    and one still running after `timeout_s`, or when `check_interrupt` raises (ComfyUI's cancel), is
    cancelled on the server (DELETE) first. `report_progress` gets the job's progress, 0..100."""
    job = client.post_json("/v1/videos", body)
    video_id = job["id"]
    deadline = time.monotonic() + timeout_s
    try:
        while job["status"] in ("queued", "in_progress"):
            report_progress(int(job.get("progress") or 0))
            check_interrupt()
            if time.monotonic() >= deadline:
                raise DiffserveError(
                    f"video {video_id} was still {job['status']} ({job.get('progress', 0)}%) after "
                    f"{timeout_s:g} s (timeout_s); it was cancelled on the server"
                )
            time.sleep(POLL_INTERVAL_S)
            job = client.get_json(f"/v1/videos/{video_id}")
    except BaseException:
        _cancel(client, video_id)
        raise
    if job["status"] != "completed":
        error = job.get("error") or {}
        why = error.get("message") or error.get("code") or "no reason given"
        raise DiffserveError(f"video {video_id} is {job['status']}: {why}")
    report_progress(100)
    return client.request("GET", f"/v1/videos/{video_id}/content")


def _cancel(client: DiffserveClient, video_id: str) -> None:
    """Stop the job on the server; the error that led here is the one to report, so a failure to cancel
    (the job just finished, or the server is gone) is not raised over it."""
    with contextlib.suppress(DiffserveError):
        client.delete(f"/v1/videos/{video_id}")
