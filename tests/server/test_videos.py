"""`/v1/videos` end to end: real `diffserve serve` processes on tiny Wan 2.1 checkpoints, driven by the
official `openai` SDK where it covers the call and raw httpx elsewhere.

One text-to-video server runs the tests in file order (jobs of earlier tests are used by later ones);
the restart test kills it and starts its successor on the same output directory. A second server, on
an image-to-video checkpoint with a 3-second --job-ttl, runs the image-to-video job and the expiry test.
The parsing and bookkeeping that need no model are checked without a server first.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import av
import httpx
import numpy as np
import openai
import pytest
from api_checks import assert_error
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from server_process import start_server

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.server import video_routes
from diffserve.server.app_state import AppState, set_app_state
from diffserve.server.args import ServerArgs
from diffserve.server.errors import install_error_handlers
from diffserve.server.health_probe import HealthProbe
from diffserve.server.metrics import ServerMetrics
from diffserve.server.protocol import JobProgress
from diffserve.server.schemas import frames_for_seconds
from diffserve.server.video_jobs import VideoJob, VideoJobStore, progress_percent
from diffserve.testing.fake_pipeline import FakeFamily, FakeGenerator, FakePipeline, video_facts

MODEL_NAME = "tiny-wan"
SIZE = 32
FPS = 8
QUICK_STEPS = 2
POLLED_STEPS = 1000  # >= 1 s of denoising even on a fast idle host: long enough to watch the progress rise
LONG_STEPS = 20000  # minutes of work: only ever cancelled or interrupted
I2V_TTL_S = 3

# The SDK marks the video API deprecated (Sora's shutdown); the calls themselves are what we test.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def stop(srv, sig: int = signal.SIGTERM) -> None:
    if srv.process.poll() is None:
        srv.process.send_signal(sig)
        try:
            srv.process.wait(30)
        except subprocess.TimeoutExpired:
            srv.process.kill()
            srv.process.wait(10)


def decode_mp4(data: bytes) -> tuple[int, int, int, float]:
    """(frames, width, height, fps) of an MP4, decoded with PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return len(frames), frames[0].shape[1], frames[0].shape[0], float(stream.average_rate)


def png_bytes(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# -- without a server ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("seconds", "fps", "expected"),
    [(4, 16, 65), (5, 16, 81), (1, 8, 9), (0.01, 16, 1), (0.375, 8, 5), (2.5, 24, 61)],
)
def test_seconds_to_nearest_valid_frame_count(seconds: float, fps: int, expected: int) -> None:
    # 0.375 s at 8 fps is exactly 3 frames, halfway between 1 and 5: ties go to the longer clip.
    assert frames_for_seconds(seconds, fps, temporal_factor=4) == expected


def test_progress_mapping() -> None:
    def at(step: int, total: int, phase: str) -> int:
        return progress_percent(JobProgress("r", step, total, phase))

    assert [at(s, 4, "denoising") for s in range(4)] == [0, 22, 45, 67]
    assert (at(4, 4, "decoding"), at(4, 4, "encoding")) == (90, 95)


def test_store_pages_and_fails_unfinished_jobs(tmp_path: Path) -> None:
    store = VideoJobStore(tmp_path / "jobs.sqlite3")
    for i, status in enumerate(["completed", "in_progress", "queued", "failed"]):
        store.insert(
            VideoJob(
                id=f"video_{i:032x}",
                status=status,
                model="m",
                prompt=f"p{i}",
                created_at=100.0,
                completed_at=200.0 if status in ("completed", "failed") else None,
                num_frames=5,
            )
        )
    ids = [f"video_{i:032x}" for i in range(4)]
    page, more = store.page(2, None, descending=True)
    assert [j.id for j in page] == ids[:1:-1] and more
    page, more = store.page(2, ids[2], descending=True)
    assert [j.id for j in page] == ids[1::-1] and not more
    page, more = store.page(10, ids[0], descending=False)
    assert [j.id for j in page] == ids[1:] and not more
    with pytest.raises(KeyError):
        store.page(1, "video_nope", descending=True)
    assert sorted(store.mark_interrupted(now=300.0)) == ids[1:3]
    failed = store.get(ids[1])
    assert (failed.status, failed.error_code, failed.completed_at, failed.num_frames) == (
        "failed",
        "server_restarted",
        300.0,
        5,
    )
    assert "server restarted" in failed.error_message
    assert store.finished_before(250.0) == [ids[0], ids[3]]
    store.close()


def test_videos_route_refuses_an_image_model() -> None:
    """The check runs before anything touches the engine, so a stand-in with the engine's info will do."""
    engine = SimpleNamespace(
        ready=True, engine_info={"task": "text-to-image", "diffusers_pipeline": "FluxPipeline"}
    )
    app = FastAPI()
    install_error_handlers(app)
    args = ServerArgs(EngineArgs(model_path="/m"))
    jobs = SimpleNamespace(ttl=60.0)
    set_app_state(
        app, AppState(args, engine, ServerMetrics(), jobs, HealthProbe(engine, 1.0, 1.0), started_at=0)
    )
    app.include_router(video_routes.router)
    with TestClient(app) as client:
        r = client.post("/v1/videos", json={"prompt": "a cat"})
    assert_error(
        r,
        400,
        "FluxPipeline, a text-to-image model: it generates images, not videos; "
        "use POST /v1/images/generations",
        param="model",
    )


def FakeVideoGenerator() -> FakeGenerator:  # noqa: N802  (reads as the class it stands in for)
    """Stands in for a Wan DiffGenerator in the engine loop: 3 fake steps, then black frames."""
    family = FakeFamily("fake-wan", "WanPipeline", "text-to-video")
    return FakeGenerator(FakePipeline(video_facts("WanPipeline")), family)


@pytest.fixture
def video_engine(tmp_path):
    from diffserve.server.engine_process import EngineProcess, EngineProcessConfig

    channel = SimpleNamespace(sent=[])
    channel.send = channel.sent.append
    config = EngineProcessConfig(EngineArgs(model_path="/fake/wan", output_path=str(tmp_path)), "", "", 1)
    engine = EngineProcess(config, channel, generator=FakeVideoGenerator())
    yield engine
    engine.encoder.shutdown(wait=True)


def test_engine_reports_progress_and_writes_the_video_off_the_step_loop(
    video_engine, tmp_path, monkeypatch
) -> None:
    from diffserve.server import engine_process
    from diffserve.server.protocol import GenerateJob, JobAccepted, JobFinished, JobStarted

    release = threading.Event()
    real_save = engine_process.save_video

    def slow_save(*args, **kwargs):
        assert release.wait(10)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(engine_process, "save_video", slow_save)
    path = tmp_path / "videos" / "v1.mp4"
    video_engine._handle(GenerateJob("v1", SamplingParams(prompt="p"), video_path=str(path), ack=True))
    video_engine.run_until_idle()  # returns while the encoder thread still waits: the loop is free
    sent = list(video_engine.channel.sent)
    assert isinstance(sent[0], JobAccepted) and sent[0].params.num_frames == 5
    assert isinstance(sent[1], JobStarted)
    assert [(m.step, m.total, m.phase) for m in sent[2:]] == [
        (1, 3, "denoising"),
        (2, 3, "denoising"),
        (3, 3, "decoding"),
        (3, 3, "encoding"),
    ]
    assert not path.exists()
    release.set()
    video_engine.encoder.shutdown(wait=True)
    finished = video_engine.channel.sent[-1]
    assert isinstance(finished, JobFinished) and finished.images == []
    video = finished.videos[0]
    assert (video.path, video.num_frames, video.width, video.height, video.fps) == (str(path), 5, 32, 32, 8)
    assert path.stat().st_size == video.size_bytes > 0


def test_engine_cancel_while_writing_deletes_the_file(video_engine, tmp_path, monkeypatch) -> None:
    from diffserve.server import engine_process
    from diffserve.server.protocol import CancelJob, GenerateJob, JobCancelled, JobRejected

    writing, release = threading.Event(), threading.Event()
    real_save = engine_process.save_video

    def slow_save(*args, **kwargs):
        writing.set()
        assert release.wait(10)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(engine_process, "save_video", slow_save)
    path = tmp_path / "videos" / "v2.mp4"
    video_engine._handle(GenerateJob("v2", SamplingParams(prompt="p"), video_path=str(path)))
    video_engine.run_until_idle()
    assert writing.wait(10)
    video_engine._handle(CancelJob("v2"))
    release.set()
    video_engine.encoder.shutdown(wait=True)
    assert isinstance(video_engine.channel.sent[-1], JobCancelled) and not path.exists()
    # An image request to a video model is refused by the engine too (the front end checks first).
    video_engine._handle(GenerateJob("img", SamplingParams(prompt="p")))
    rejected = video_engine.channel.sent[-1]
    assert isinstance(rejected, JobRejected) and "use POST /v1/videos" in rejected.message


# -- text-to-video server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan_t2v_dir(tmp_path_factory):
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan-t2v"), TinyWanSpec())


@pytest.fixture(scope="module")
def t2v(wan_t2v_dir, tmp_path_factory):
    """A holder of the current text-to-video server (the restart test swaps in its successor)."""
    # One job at a time: the cancel tests need a job that waits behind a running one (batching is
    # tested in test_batching.py and the engine loop tests).
    holder = SimpleNamespace(
        args=(
            "--served-model-name",
            MODEL_NAME,
            "--shutdown-timeout",
            "2",
            "--max-running-requests",
            "1",
            "--max-inference-steps",
            str(LONG_STEPS),  # LONG_STEPS is above the default limit
        ),  # fmt: skip
        srv=None,
    )
    holder.srv = start_server(wan_t2v_dir, tmp_path_factory.mktemp("t2v"), *holder.args)
    try:
        holder.srv.wait_ready()
        yield holder
    finally:
        stop(holder.srv)


@pytest.fixture
def srv(t2v):
    return t2v.srv


@pytest.fixture
def client(srv) -> openai.OpenAI:
    return srv.openai_client(timeout=30)


def create(srv, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/videos", json=body, timeout=30, **kwargs)


def get_job(srv, video_id: str) -> dict:
    r = httpx.get(f"{srv.base_url}/v1/videos/{video_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_job(srv, video_id: str, statuses: tuple[str, ...] = ("completed",), timeout: float = 60) -> dict:
    job = {}

    def done() -> bool:
        nonlocal job
        job = get_job(srv, video_id)
        return job["status"] in statuses

    srv.wait_for(done, timeout, interval=0.05, what=lambda: f"job {video_id} to be {statuses}: {job}")
    return job


def quick_job(srv, **fields) -> dict:
    r = create(
        srv,
        {
            "prompt": "a tiny clip",
            "size": f"{SIZE}x{SIZE}",
            "num_frames": 5,
            "fps": FPS,
            "num_inference_steps": QUICK_STEPS,
            **fields,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def running_job(srv, steps: int = LONG_STEPS) -> dict:
    job = quick_job(srv, num_inference_steps=steps, prompt="a long clip")
    return wait_job(srv, job["id"], ("in_progress",))


def test_create_poll_and_download_with_the_openai_sdk(srv, client, t2v) -> None:
    video = client.videos.create(
        prompt="a red fox running",
        seconds="1",
        size=f"{SIZE}x{SIZE}",
        model=MODEL_NAME,
        extra_body={"fps": FPS, "seed": 7, "num_inference_steps": POLLED_STEPS},
    )
    # An idle engine may start the job before the POST's answer is rendered: queued or just started.
    assert (video.object, video.model) == ("video", MODEL_NAME)
    assert (video.status, video.progress) == ("queued", 0) or video.status == "in_progress"
    assert video.id.startswith("video_") and video.error is None and video.completed_at is None
    assert (video.size, video.seconds) == (f"{SIZE}x{SIZE}", "1.125")  # 1 s at 8 fps -> 9 frames (4k+1)
    extras = video.model_extra
    assert (extras["num_frames"], extras["fps"], extras["seed"], extras["num_inference_steps"]) == (
        9,
        FPS,
        7,
        POLLED_STEPS,
    )

    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video.id)
        seen.append((video.status, video.progress))
        if video.status in ("completed", "failed"):
            break
        time.sleep(0.03)
    assert video.status == "completed", (video, seen)
    progress = [p for _, p in seen]
    assert progress == sorted(progress), seen  # never goes back
    denoising = {p for status, p in seen if status == "in_progress" and 0 < p < 90}
    assert len(denoising) >= 3, f"progress should rise step by step, saw {seen}"
    assert video.progress == 100 and video.error is None
    assert video.completed_at >= video.created_at and video.expires_at == video.completed_at + 86400
    assert (video.model_extra["quality"], video.model_extra["steps_computed_in_full"]) == (
        "high",
        POLLED_STEPS,
    )

    data = client.videos.download_content(video.id).read()
    assert data[4:8] == b"ftyp"
    assert decode_mp4(data) == (9, SIZE, SIZE, FPS)
    t2v.first_video = (video.id, data)


def test_range_requests_get_206_with_the_right_bytes(srv, t2v) -> None:
    video_id, data = t2v.first_video
    url = f"{srv.base_url}/v1/videos/{video_id}/content"
    full = httpx.get(url, timeout=10)
    assert full.status_code == 200 and full.content == data
    assert full.headers["content-type"] == "video/mp4" and full.headers["accept-ranges"] == "bytes"
    part = httpx.get(url, headers={"Range": "bytes=10-99"}, timeout=10)
    assert part.status_code == 206, part.text
    assert part.headers["content-range"] == f"bytes 10-99/{len(data)}" and part.content == data[10:100]
    tail = httpx.get(url, params={"variant": "video"}, headers={"Range": "bytes=-16"}, timeout=10)
    assert tail.status_code == 206 and tail.content == data[-16:]
    assert httpx.get(url, headers={"Range": f"bytes={len(data)}-"}, timeout=10).status_code == 416


def test_list_paginates_newest_first(srv, client, t2v) -> None:
    ids = [t2v.first_video[0]] + [quick_job(srv, seed=i)["id"] for i in range(2)]
    for video_id in ids[1:]:
        wait_job(srv, video_id)
    page = httpx.get(f"{srv.base_url}/v1/videos", params={"limit": 2}, timeout=10).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [v["id"] for v in page["data"]] == ids[:0:-1]
    assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
    rest = httpx.get(
        f"{srv.base_url}/v1/videos", params={"limit": 2, "after": page["last_id"]}, timeout=10
    ).json()
    assert [v["id"] for v in rest["data"]] == ids[:1] and rest["has_more"] is False
    asc = client.videos.list(limit=1, order="asc")
    assert [v.id for v in asc.data] == ids[:1] and asc.has_more
    assert [v.id for v in client.videos.list(limit=1)] == ids[::-1]  # the SDK follows `after` by itself
    assert_error(
        httpx.get(f"{srv.base_url}/v1/videos", params={"after": "video_" + "0" * 32}, timeout=10),
        400,
        "is not a video on this server",
        param="after",
    )


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"num_frames": 6}, "num_frames must be 4k+1", "num_frames"),
        ({"size": "40x32"}, "width=40 is not a multiple of 16", "size"),
        ({"size": "big"}, "size must be 'WIDTHxHEIGHT'", "size"),
        ({"size": "8192x32"}, "out of range", "size"),
        ({"seconds": "1", "num_frames": 5}, "either seconds or num_frames, not both", "seconds"),
        ({"seconds": 1000}, "this model makes at most 1025 frames", "seconds"),
        ({"seconds": "soon"}, "seconds: Input should be a valid number", "seconds"),
        ({"quality": "ultra"}, "quality must be one of auto, high, medium, low, draft", "quality"),
        ({"shots": 3}, "unknown field 'shots'; accepted fields: prompt, model, size, seconds", "shots"),
        (
            {"input_reference": "data:image/png;base64,AAAA"},
            # The list names every registered image-to-video pipeline (it grows with the families).
            "takes no input_reference; animating an image needs an image-to-video model (WanImageToVideoPipeline",
            "input_reference",
        ),
        ({"model": "sora-2"}, "is not served here", "model"),
        ({"prompt": " "}, "prompt must be a non-empty string", "prompt"),
    ],
)
def test_bad_requests_are_400_and_never_recorded(srv, body: dict, message: str, param: str) -> None:
    before = httpx.get(f"{srv.base_url}/v1/videos", params={"limit": 100}, timeout=10).json()["data"]
    r = create(
        srv, {"prompt": "a clip", "size": f"{SIZE}x{SIZE}", "num_inference_steps": QUICK_STEPS, **body}
    )
    assert_error(r, 404 if param == "model" else 400, message, param=param)
    after = httpx.get(f"{srv.base_url}/v1/videos", params={"limit": 100}, timeout=10).json()["data"]
    assert [v["id"] for v in after] == [v["id"] for v in before]


def test_bad_multipart_request_from_the_sdk(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(
            prompt="a clip", size="32x32", extra_body={"num_frames": 7, "num_inference_steps": 2}
        )
    assert "num_frames must be 4k+1" in info.value.message and info.value.body["param"] == "num_frames"


def test_unknown_ids_unready_content_and_other_variants(srv, t2v) -> None:
    assert_error(httpx.get(f"{srv.base_url}/v1/videos/video_{'0' * 32}", timeout=10), 404, "no video with id")
    assert_error(httpx.get(f"{srv.base_url}/v1/videos/../etc/passwd", timeout=10), 404, "")
    assert_error(httpx.delete(f"{srv.base_url}/v1/videos/nope", timeout=10), 404, "no video with id")
    video_id = t2v.first_video[0]
    assert_error(
        httpx.get(
            f"{srv.base_url}/v1/videos/{video_id}/content", params={"variant": "thumbnail"}, timeout=10
        ),
        400,
        "'thumbnail' is not generated by diffserve",
        param="variant",
    )
    job = running_job(srv)
    assert_error(
        httpx.get(f"{srv.base_url}/v1/videos/{job['id']}/content", timeout=10),
        409,
        "is in_progress, not completed",
    )
    assert httpx.delete(f"{srv.base_url}/v1/videos/{job['id']}", timeout=30).status_code == 200


def test_delete_cancels_running_and_queued_jobs_within_a_step(srv, client) -> None:
    running = running_job(srv)
    queued = quick_job(srv, prompt="waits behind the long one")
    assert get_job(srv, queued["id"])["status"] == "queued"
    assert client.videos.delete(queued["id"]).deleted is True
    assert get_job(srv, queued["id"])["status"] == "cancelled"

    start = time.monotonic()
    deleted = client.videos.delete(running["id"])
    elapsed = time.monotonic() - start
    assert (deleted.id, deleted.object, deleted.deleted) == (running["id"], "video.deleted", True)
    assert elapsed < 3, f"DELETE waits for the engine to stop, which takes a step; took {elapsed:.2f} s"
    job = get_job(srv, running["id"])
    assert job["status"] == "cancelled" and job["completed_at"] is not None
    assert srv.info()["engine"]["running"] == 0  # the engine has stopped the job, not just been asked to
    srv.wait_for(
        lambda: f"Request {running['id']} cancelled at step" in srv.log(), 10, what="the engine's cancel"
    )
    videos = srv.output_dir / "videos"
    time.sleep(0.3)
    assert not any(running["id"] in p.name or queued["id"] in p.name for p in videos.iterdir())
    # A second DELETE removes the cancelled record; a finished job goes at once, with its file.
    assert client.videos.delete(running["id"]).deleted
    assert httpx.get(f"{srv.base_url}/v1/videos/{running['id']}", timeout=10).status_code == 404
    done = quick_job(srv)
    wait_job(srv, done["id"])
    assert (videos / f"{done['id']}.mp4").is_file()
    assert client.videos.delete(done["id"]).deleted
    assert not (videos / f"{done['id']}.mp4").exists()
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(done["id"])


def test_image_route_points_to_videos(srv) -> None:
    r = httpx.post(
        f"{srv.base_url}/v1/images/generations", json={"prompt": "a cat", "size": "32x32"}, timeout=10
    )
    assert_error(
        r,
        400,
        "WanPipeline, a text-to-video model: it generates videos, not images; use POST /v1/videos",
        param="model",
    )
    assert httpx.get(f"{srv.base_url}/health_generate", timeout=60).status_code == 200


def test_restart_keeps_finished_jobs_and_fails_interrupted_ones(t2v, wan_t2v_dir, tmp_path) -> None:
    srv = t2v.srv
    finished_id, data = t2v.first_video
    running = running_job(srv)
    queued = quick_job(srv, prompt="never starts")
    engine_pid = srv.info()["engine"]["pid"]
    stop(srv, signal.SIGKILL)  # a crash: nothing gets to record anything

    def engine_gone() -> bool:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return True
        return False

    srv.wait_for(engine_gone, 30, what="the orphaned engine to exit")
    t2v.srv = new = start_server(wan_t2v_dir, tmp_path, *t2v.args, output_dir=srv.output_dir)
    new.wait_ready()
    listed = {
        v["id"]: v
        for v in httpx.get(f"{new.base_url}/v1/videos", params={"limit": 100}, timeout=10).json()["data"]
    }
    assert listed[finished_id]["status"] == "completed"
    assert httpx.get(f"{new.base_url}/v1/videos/{finished_id}/content", timeout=10).content == data
    for video_id in (running["id"], queued["id"]):
        job = get_job(new, video_id)
        assert job["status"] == "failed" and job["error"]["code"] == "server_restarted", job
        assert "server restarted" in job["error"]["message"]
        assert_error(httpx.get(f"{new.base_url}/v1/videos/{video_id}/content", timeout=10), 409, "is failed")
    # The new server runs new jobs as usual.
    assert wait_job(new, quick_job(new)["id"])["progress"] == 100


# -- image-to-video server (with a short --job-ttl) ------------------------------------------------
@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    model_dir = build_tiny_wan(tmp_path_factory.mktemp("tiny-wan-i2v"), TinyWanSpec(image_to_video=True))
    srv = start_server(model_dir, tmp_path_factory.mktemp("i2v"), "--job-ttl", str(I2V_TTL_S))
    try:
        srv.wait_ready()
        yield srv
    finally:
        stop(srv)


def test_image_to_video_job_with_input_reference(i2v, tmp_path) -> None:
    client = i2v.openai_client(timeout=30)
    image_path = tmp_path / "first-frame.png"
    image_path.write_bytes(png_bytes(40, 40))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with open(image_path, "rb") as image:
            video = client.videos.create(
                prompt="the picture comes alive",
                input_reference=image,
                seconds="0.5",
                size=f"{SIZE}x{SIZE}",
                extra_body={"fps": FPS, "num_inference_steps": 2},
            )
    assert video.status == "queued" and video.model_extra["image_to_video"] is True
    assert video.model_extra["num_frames"] == 5  # 0.5 s at 8 fps = 4 frames -> nearest 4k+1 is 5
    job = wait_job(i2v, video.id)
    data = httpx.get(f"{i2v.base_url}/v1/videos/{video.id}/content", timeout=10).content
    assert decode_mp4(data) == (5, SIZE, SIZE, FPS) and job["seconds"] == "0.625"
    r = httpx.post(f"{i2v.base_url}/v1/videos", json={"prompt": "no image", "size": "32x32"}, timeout=10)
    assert_error(
        r, 400, "is an image-to-video model: send the first frame as input_reference", param="input_reference"
    )


def test_finished_jobs_expire_after_the_ttl(i2v) -> None:
    image = "data:image/png;base64," + base64.b64encode(png_bytes(32, 32)).decode()
    r = httpx.post(
        f"{i2v.base_url}/v1/videos",
        timeout=10,
        json={
            "prompt": "short-lived",
            "size": "32x32",
            "num_frames": 1,
            "num_inference_steps": 1,
            "input_reference": {"image_url": image},
        },
    )
    assert r.status_code == 200, r.text
    job = wait_job(i2v, r.json()["id"])
    assert job["expires_at"] == pytest.approx(job["completed_at"] + I2V_TTL_S, abs=1)
    path = i2v.output_dir / "videos" / f"{job['id']}.mp4"
    assert path.is_file()

    def gone() -> bool:
        return httpx.get(f"{i2v.base_url}/v1/videos/{job['id']}", timeout=10).status_code == 404

    i2v.wait_for(gone, I2V_TTL_S + 5, interval=0.2, what="the job to expire")
    assert time.time() >= job["completed_at"] + I2V_TTL_S - 1
    assert not path.exists()
    listed = httpx.get(f"{i2v.base_url}/v1/videos", timeout=10).json()["data"]
    assert job["id"] not in [v["id"] for v in listed]
