"""The server's lifecycle (issue 17 items 5, 12 and 18): shutdown speeds and the video job store.

- SIGTERM drains video jobs too: a running job gets `--shutdown-timeout` to finish (its MP4 is written and
  its record says completed), and is cancelled once that timeout is over (its record says why). Meanwhile
  the server answers: new work and /health get 503, the job can be polled.
- A second Ctrl-C stops at once: the engine process is killed, the request in flight gets OpenAI's 503
  error, the process exits (no hang in multiprocessing's exit-time join) and the IPC socket folder goes.
- Only a video model gets `video_jobs.sqlite3`; /v1/videos on an image model says which route to use;
  the content of a cancelled or failed job is a 409 that says what happened.

The store, route and engine-client checks run in-process; the signals are sent to real `diffserve serve`
processes on tiny checkpoints (tiny Wan 2.1 for the video jobs, the session's tiny FLUX for Ctrl-C).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from api_checks import assert_error
from fastapi import FastAPI
from fastapi.testclient import TestClient
from push_recorder import PushRecorder
from server_process import ServerProcess, start_server

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.server import protocol as msg
from diffserve.server import video_routes
from diffserve.server.app_state import AppState, set_app_state
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient, EngineState, EngineUnavailableError
from diffserve.server.errors import install_error_handlers
from diffserve.server.health_probe import HealthProbe
from diffserve.server.metrics import ServerMetrics
from diffserve.server.video_jobs import VideoJob, VideoJobManager, VideoJobStore

IMAGE_INFO = {"task": "text-to-image", "diffusers_pipeline": "FluxPipeline"}
VIDEO_INFO = {"task": "text-to-video", "diffusers_pipeline": "WanPipeline"}
LONG_STEPS = 20000  # minutes of work on the tiny models: only ever cancelled or interrupted
FEW_SECONDS_STEPS = 1500  # seconds of denoising on the tiny Wan (0.004 s a step on an idle CPU)
EXIT_WAIT_S = 120  # far below the long --shutdown-timeout: exiting within it is not a wait for the timeout


def engine_client(tmp_path: Path, on_fatal=lambda code, message: None) -> EngineClient:
    args = ServerArgs(EngineArgs(model_path="/m", output_path=str(tmp_path)))
    client = EngineClient(args, ServerMetrics(), on_fatal)
    client._push, client.state = PushRecorder(), EngineState.STARTING
    return client


def ready(client: EngineClient, info: dict) -> None:
    client._dispatch(msg.EngineReady(pid=os.getpid(), info=info, probe_size=64))


# -- the video job store exists only for a video model ----------------------------------------------
def test_the_engine_client_runs_ready_hooks_before_accepting_requests(tmp_path: Path) -> None:
    client = engine_client(tmp_path)
    seen: list[tuple[dict, bool]] = []
    client.ready_hooks.append(lambda info: seen.append((info, client.ready)))
    ready(client, VIDEO_INFO)
    assert seen == [(VIDEO_INFO, False)] and client.ready


def test_a_failing_ready_hook_fails_the_engine_client(tmp_path: Path) -> None:
    fatal: list[tuple[int, str]] = []
    client = engine_client(tmp_path, on_fatal=lambda code, message: fatal.append((code, message)))

    def broken(info: dict) -> None:
        raise OSError("disk full")

    client.ready_hooks.append(broken)
    ready(client, VIDEO_INFO)
    assert client.state == EngineState.FAILED and not client.ready
    assert fatal == [(1, "OSError: disk full")]
    assert "disk full" in str(client.unavailable_error())


def test_the_video_store_is_opened_only_for_a_video_model(tmp_path: Path) -> None:
    async def scenario() -> None:
        jobs = VideoJobManager(tmp_path, 60.0, engine=None, metrics=ServerMetrics())
        jobs.on_engine_ready(IMAGE_INFO)
        assert not jobs.is_open and not list(tmp_path.iterdir())  # no video_jobs.sqlite3, no videos/
        jobs.on_engine_ready(VIDEO_INFO)
        store = jobs.store
        assert jobs.is_open and (tmp_path / "video_jobs.sqlite3").is_file() and (tmp_path / "videos").is_dir()
        jobs.on_engine_ready(VIDEO_INFO)  # a restarted engine: the same store
        assert jobs.store is store
        await jobs.close()

    asyncio.run(scenario())


def video_app(tmp_path: Path, info: dict) -> tuple[FastAPI, VideoJobManager]:
    """The /v1/videos routes over a real job manager and a stand-in for a ready engine with `info`."""
    engine = SimpleNamespace(ready=True, engine_info=info)
    jobs = VideoJobManager(tmp_path, 60.0, engine, ServerMetrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        jobs.on_engine_ready(info)
        yield
        await jobs.close()

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)
    args = ServerArgs(EngineArgs(model_path="/m", output_path=str(tmp_path)))
    probe = HealthProbe(engine, 1.0, 1.0)
    set_app_state(app, AppState(args, engine, ServerMetrics(), jobs, probe, started_at=0))
    app.include_router(video_routes.router)
    return app, jobs


def test_video_routes_of_an_image_model_name_the_route_to_use(tmp_path: Path) -> None:
    app, _ = video_app(tmp_path, IMAGE_INFO)
    video_id = "video_" + "0" * 32
    with TestClient(app) as client:
        for method, path in [
            ("GET", "/v1/videos"),
            ("GET", f"/v1/videos/{video_id}"),
            ("GET", f"/v1/videos/{video_id}/content"),
            ("DELETE", f"/v1/videos/{video_id}"),
        ]:
            error = assert_error(client.request(method, path), 400, "it generates images, not videos")
            assert (error["param"], error["code"]) == ("model", "unsupported_model")
    assert not (tmp_path / "video_jobs.sqlite3").exists()


def test_content_of_a_job_without_a_video_says_what_happened(tmp_path: Path) -> None:
    app, jobs = video_app(tmp_path, VIDEO_INFO)
    ids = {status: f"video_{i:032x}" for i, status in enumerate(["cancelled", "failed", "in_progress"])}
    with TestClient(app) as client:
        assert jobs.store is not None
        for status, video_id in ids.items():
            finished = status != "in_progress"
            error = ("shutting_down", "the server is shutting down") if status == "failed" else (None, None)
            job = VideoJob(
                video_id, status, "m", "p", time.time(), completed_at=time.time() if finished else None
            )
            job.error_code, job.error_message = error
            jobs.store.insert(job)

        def content_error(status: str) -> str:
            response = client.get(f"/v1/videos/{ids[status]}/content")
            return assert_error(response, 409, f"video {ids[status]}")["message"]

        assert (
            content_error("cancelled")
            == f"video {ids['cancelled']} was cancelled (DELETE); it has no content"
        )
        failed = content_error("failed")
        assert failed == f"video {ids['failed']} is failed: the server is shutting down; it has no content"
        assert "available once status is 'completed'" in content_error("in_progress")


# -- abort: what a second Ctrl-C does to the engine client ------------------------------------------
def test_abort_answers_in_flight_requests_kills_the_engine_and_removes_the_socket_folder(
    tmp_path: Path,
) -> None:
    engine_process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    engine_process.start()
    ipc_dir = tmp_path / "diffserve-ipc"
    ipc_dir.mkdir()

    async def scenario() -> None:
        client = engine_client(tmp_path)
        ready(client, IMAGE_INFO)
        client._process, client._ipc_dir = engine_process, ipc_dir
        request = asyncio.create_task(client.generate(msg.GenerateJob("r1", SamplingParams(prompt="p"))))
        await asyncio.sleep(0)
        client.begin_drain(600.0)
        await asyncio.sleep(0)
        assert not request.done()  # the drain waits for it
        client.abort("stopped at once")
        with pytest.raises(EngineUnavailableError, match="stopped at once") as info:
            await request
        assert info.value.code == "shutting_down"
        await asyncio.wait_for(client.wait_drained(), 5)  # the cancelled drain does not hold up the shutdown
        assert client.state == EngineState.STOPPED

    try:
        asyncio.run(scenario())
        assert not engine_process.is_alive() and engine_process.exitcode == -signal.SIGKILL
        assert not ipc_dir.exists()
    finally:
        if engine_process.is_alive():
            engine_process.kill()
        engine_process.join(10)


# -- real servers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"), TinyWanSpec())


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    """Starts servers (ready) and kills any still running at the end."""
    servers: list[ServerProcess] = []

    def start(model_dir: Path, *flags: str) -> ServerProcess:
        srv = start_server(model_dir, tmp_path, *flags)
        servers.append(srv)
        srv.wait_ready()
        return srv

    yield start
    for srv in servers:
        if srv.process.poll() is None:
            srv.process.kill()
            srv.process.wait(30)


def start_video_job(srv: ServerProcess, steps: int) -> str:
    """A text-to-video job, once its denoising has begun."""
    body = {"prompt": "a clip", "size": "32x32", "num_frames": 5, "fps": 8, "num_inference_steps": steps}
    r = httpx.post(f"{srv.base_url}/v1/videos", json=body, timeout=30)
    assert r.status_code == 200, r.text
    video_id = r.json()["id"]

    def denoising() -> bool:
        job = httpx.get(f"{srv.base_url}/v1/videos/{video_id}", timeout=10).json()
        return job["status"] == "in_progress" and job["progress"] > 0

    srv.wait_for(denoising, 60, interval=0.05, what=f"job {video_id} denoising")
    return video_id


def stored_job(srv: ServerProcess, video_id: str) -> VideoJob:
    """The job's record as the stopped server left it (what a restarted server would show)."""
    store = VideoJobStore(srv.output_dir / "video_jobs.sqlite3")
    try:
        job = store.get(video_id)
    finally:
        store.close()
    assert job is not None
    return job


def test_sigterm_lets_a_running_video_job_finish_within_the_shutdown_timeout(launch, wan_dir: Path) -> None:
    srv = launch(wan_dir, "--shutdown-timeout", "600", "--max-inference-steps", str(LONG_STEPS))
    video_id = start_video_job(srv, FEW_SECONDS_STEPS)
    srv.process.send_signal(signal.SIGTERM)
    srv.wait_for(lambda: "Received SIGTERM" in srv.log(), 30, what="SIGTERM handled")
    # While it drains the server still answers: new work and /health get 503, the job can be polled.
    new_job = {"prompt": "too late", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
    refused = assert_error(
        httpx.post(f"{srv.base_url}/v1/videos", json=new_job, timeout=10), 503, "shutting down"
    )
    assert refused["code"] == "shutting_down"
    assert_error(httpx.get(f"{srv.base_url}/health", timeout=10), 503, "shutting down")
    poll = httpx.get(f"{srv.base_url}/v1/videos/{video_id}", timeout=10)
    assert poll.status_code == 200 and poll.json()["status"] == "in_progress", poll.text
    assert srv.process.wait(EXIT_WAIT_S) == 0
    log = srv.log()
    assert "Shutting down: waiting up to 600.0 seconds for 1 request(s) in flight" in log  # it was running
    assert "Shutdown timeout" not in log
    job = stored_job(srv, video_id)
    assert (job.status, job.progress, job.error_code) == ("completed", 100, None)
    mp4 = srv.output_dir / "videos" / f"{video_id}.mp4"
    assert mp4.is_file() and mp4.stat().st_size == job.file_bytes > 0


def test_sigterm_cancels_a_video_job_once_the_shutdown_timeout_is_over(launch, wan_dir: Path) -> None:
    srv = launch(wan_dir, "--shutdown-timeout", "1", "--max-inference-steps", str(LONG_STEPS))
    video_id = start_video_job(srv, LONG_STEPS)
    srv.process.send_signal(signal.SIGTERM)
    assert srv.process.wait(EXIT_WAIT_S) == 0
    assert "Shutdown timeout: cancelling 1 request(s)" in srv.log()
    job = stored_job(srv, video_id)
    assert (job.status, job.error_code) == ("failed", "shutting_down")
    assert "after its 1 s shutdown timeout" in (job.error_message or "")
    assert not any(video_id in path.name for path in (srv.output_dir / "videos").iterdir())


def test_a_second_ctrl_c_stops_at_once(launch, tiny_flux_dir: Path) -> None:
    srv = launch(
        tiny_flux_dir, "--shutdown-timeout", "600", "--max-running-requests", "1",
        "--max-inference-steps", str(LONG_STEPS),
    )  # fmt: skip
    match = re.search(r"Engine link: ZeroMQ IPC sockets in (\S+)", srv.log())
    assert match is not None, srv.log()
    ipc_dir = Path(match.group(1))
    assert ipc_dir.is_dir()
    engine_pid = srv.info()["engine"]["pid"]
    result: dict[str, httpx.Response] = {}

    def long_request() -> None:
        body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": LONG_STEPS}
        result["response"] = httpx.post(
            f"{srv.base_url}/v1/images/generations", json=body, timeout=EXIT_WAIT_S
        )

    client = threading.Thread(target=long_request)
    client.start()
    srv.wait_for(lambda: srv.info()["engine"]["running"] == 1, 60, what="the long request running")
    srv.process.send_signal(signal.SIGINT)
    srv.wait_for(lambda: "Received SIGINT: shutting down" in srv.log(), 30, what="the first Ctrl-C handled")
    srv.process.send_signal(signal.SIGINT)
    try:
        exit_code = srv.process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after a second Ctrl-C\n{srv.log()[-4000:]}")
    client.join(30)
    assert exit_code == 130
    error = assert_error(result["response"], 503, "the server was stopped at once (SIGINT received twice)")
    assert error["code"] == "shutting_down"
    assert "Received SIGINT again: stopping at once" in srv.log()
    assert not ipc_dir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
