"""Issue 17's defects in the front end, driven in-process against `create_app` with an engine client whose
engine process is replaced by a recorder (no model, no subprocess; the queue accounting is the real one):

- `/health_generate` (open without the API key) runs at most one probe generation, shared by concurrent
  callers, reuses a recent result, counts against `--max-queue-size`, and is cancelled when its callers leave;
- `HEAD /health` is answered;
- url images expire after `--job-ttl` (at start, by the sweeper, and on access), half-written `.partial`
  files are removed at start, and ids with a trailing newline are refused;
- bad Range headers on the content routes get OpenAI's JSON error, not text/plain;
- the official `openai` client still works on the url route.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
from push_recorder import PushRecorder

import diffserve.server.app as app_module
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.server import protocol as msg
from diffserve.server.app_state import app_state_of
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient, EngineState, EngineUnavailableError
from diffserve.server.image_files import (
    expire_images,
    find_image,
    image_path,
    remove_partial_images,
    sweep_interval,
)
from diffserve.server.streaming import ContentFileResponse

API_KEY = "k-123"
IMAGE_ID = "ab" * 16 + "-0"


class FakeEngineClient(EngineClient):
    """The real EngineClient (queue, futures, cancel) without the engine process: jobs go to a PushRecorder
    and tests answer them with `finish`. `auto_finish`: every job is answered at once (url files written)."""

    auto_finish = False

    async def start(self) -> None:
        self.incarnation += 1
        self.state, self.engine_info = EngineState.READY, {"task": "text-to-image"}
        self._push = PushRecorder(self._auto if self.auto_finish else None)
        self._tasks = []

    async def stop(self) -> None:
        self.state = EngineState.STOPPED
        self._fail_all(EngineUnavailableError("the server has stopped", code="shutting_down"))

    def finish(self, job: msg.GenerateJob) -> None:
        p = dataclasses.replace(job.params, width=64, height=64, seed=7, num_inference_steps=1)
        images = []
        for i in range(p.num_outputs_per_prompt):
            image_id = f"{job.request_id}-{i}"
            data = b"\x89PNG fake"
            if job.response_format == "url":
                image_path(self.args.output_dir, image_id, "png").write_bytes(data)
                data = None
            images.append(msg.EncodedImage(data=data, image_id=image_id, content_type="image/png"))
        self._dispatch(msg.JobFinished(job.request_id, images, p, {}, [], None, 0.01, 0.0))

    def _auto(self, job: msg.GenerateJob) -> None:
        asyncio.get_running_loop().call_soon(self.finish, job)


def make_app(tmp_path: Path, monkeypatch, engine_cls=FakeEngineClient, **server_args):
    monkeypatch.setattr(app_module, "EngineClient", engine_cls)
    out = tmp_path / "outputs"
    out.mkdir(exist_ok=True)
    args = ServerArgs(EngineArgs(model_path=str(tmp_path / "m"), output_path=str(out)), **server_args)
    app = app_module.create_app(args)
    return app, app_state_of(app).engine, out


async def call(app, method: str, path: str, headers: dict | None = None, leave: asyncio.Event | None = None):
    """One request through the whole ASGI stack: (status, headers, body). `leave`: once set, the client
    disconnects (what `receive` reports after the request body)."""
    query = b""
    if "?" in path:
        path, q = path.split("?", 1)
        query = q.encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
        "root_path": "", "server": ("testserver", 80), "client": ("127.0.0.1", 5000),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }  # fmt: skip
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await (leave.wait() if leave is not None else asyncio.Event().wait())
        return {"type": "http.disconnect"}

    start: dict = {}
    chunks: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    headers_out = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start.get("status"), headers_out, b"".join(chunks)


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def error_of(body: bytes) -> dict:
    payload = json.loads(body)
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    return payload["error"]


# -- /health_generate ------------------------------------------------------------------------------


def test_health_generate_runs_one_probe_for_concurrent_callers_and_reuses_it(tmp_path, monkeypatch) -> None:
    app, engine, _ = make_app(tmp_path, monkeypatch, api_key=API_KEY, max_queue_size=4)

    async def scenario():
        async with app.router.lifespan_context(app):
            callers = [asyncio.create_task(call(app, "GET", "/health_generate")) for _ in range(200)]
            await settle(20)
            [probe] = engine._push.jobs()  # not 200 jobs: one generation, shared
            assert probe.internal and probe.params.num_inference_steps == 1
            assert engine.num_waiting == 1
            engine.finish(probe)
            answers = await asyncio.gather(*callers)
            assert {status for status, _, _ in answers} == {200}  # no API key needed
            bodies = [json.loads(body) for _, _, body in answers]
            assert all(b["status"] == "ok" and b["cached"] is False for b in bodies)
            assert len({b["seconds"] for b in bodies}) == 1
            # Within HEALTH_GENERATE_REUSE_S: the last result, no new generation.
            status, _, body = await call(app, "GET", "/health_generate")
            assert status == 200 and json.loads(body)["cached"] is True
            assert len(engine._push.jobs()) == 1
            # An authenticated request is not refused because of the probes (the 429).
            engine.auto_finish = True
            engine._push.on_job = engine._auto
            headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as c:
                r = await c.post("/v1/images/generations", json={"prompt": "a fox"})
            assert r.status_code == 200, r.text

    asyncio.run(scenario())


def test_health_generate_reruns_after_the_reuse_window(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(app_module, "HEALTH_GENERATE_REUSE_S", 0.05)
    app, engine, _ = make_app(tmp_path, monkeypatch)

    async def scenario():
        async with app.router.lifespan_context(app):
            engine._push.on_job = engine._auto
            assert (await call(app, "GET", "/health_generate"))[0] == 200
            await asyncio.sleep(0.1)
            status, _, body = await call(app, "GET", "/health_generate")
            assert status == 200 and json.loads(body)["cached"] is False
            assert len(engine._push.jobs()) == 2

    asyncio.run(scenario())


def params(prompt: str = "x") -> SamplingParams:
    return SamplingParams(prompt=prompt)


def test_health_generate_counts_against_the_queue(tmp_path, monkeypatch) -> None:
    app, engine, _ = make_app(tmp_path, monkeypatch, max_queue_size=2)

    async def scenario():
        async with app.router.lifespan_context(app):
            jobs = [msg.GenerateJob(f"{i:032x}", params()) for i in range(2)]
            waiting = [asyncio.create_task(engine.generate(job)) for job in jobs]
            await settle()
            assert engine.num_waiting == 2
            status, _, body = await call(app, "GET", "/health_generate")
            assert status == 429 and error_of(body)["code"] == "queue_full"
            assert len(engine._push.jobs()) == 2  # the probe never reached the engine
            for job in jobs:
                engine.finish(job)
            await asyncio.gather(*waiting)
            # Room again: the probe runs, and takes a place in the queue while it waits.
            caller = asyncio.create_task(call(app, "GET", "/health_generate"))
            await settle(20)
            assert engine.num_waiting == 1
            engine.finish(engine._push.jobs()[-1])
            assert (await caller)[0] == 200

    asyncio.run(scenario())


def test_health_generate_is_cancelled_when_no_caller_waits(tmp_path, monkeypatch) -> None:
    app, engine, _ = make_app(tmp_path, monkeypatch)

    async def scenario():
        async with app.router.lifespan_context(app):
            first, second = asyncio.Event(), asyncio.Event()
            a = asyncio.create_task(call(app, "GET", "/health_generate", leave=first))
            b = asyncio.create_task(call(app, "GET", "/health_generate", leave=second))
            await settle(20)
            [probe] = engine._push.jobs()
            first.set()
            assert (await a)[0] == 499
            await settle(20)
            assert engine._push.cancels() == []  # one caller still waits for it
            second.set()
            assert (await b)[0] == 499
            await settle(20)
            assert engine._push.cancels() == [probe.request_id]
            assert engine.num_waiting == 0 and not engine._pending
            # The next caller starts a new probe rather than joining the cancelled one.
            engine._push.on_job = engine._auto
            status, _, body = await call(app, "GET", "/health_generate")
            assert status == 200 and json.loads(body)["cached"] is False

    asyncio.run(scenario())


def test_health_generate_failure_is_a_503(tmp_path, monkeypatch) -> None:
    app, engine, _ = make_app(tmp_path, monkeypatch)

    async def scenario():
        async with app.router.lifespan_context(app):
            caller = asyncio.create_task(call(app, "GET", "/health_generate"))
            await settle(20)
            [probe] = engine._push.jobs()
            engine._dispatch(msg.JobFailed(probe.request_id, "boom"))
            status, _, body = await caller
            assert status == 503 and error_of(body)["code"] == "health_check_failed"

    asyncio.run(scenario())


# -- HEAD /health ----------------------------------------------------------------------------------


def test_head_health(tmp_path, monkeypatch) -> None:
    app, engine, _ = make_app(tmp_path, monkeypatch, api_key=API_KEY)

    async def scenario():
        async with app.router.lifespan_context(app):
            status, headers, _ = await call(app, "HEAD", "/health")
            assert status == 200 and headers["content-type"] == "application/json"
            engine.state = EngineState.RESTARTING
            assert (await call(app, "HEAD", "/health"))[0] == 503
            assert (await call(app, "GET", "/health"))[0] == 503

    asyncio.run(scenario())
    operation_ids = [op["operationId"] for path in app.openapi()["paths"].values() for op in path.values()]
    assert len(operation_ids) == len(set(operation_ids))


# -- url images: ids, TTL, partial files -----------------------------------------------------------


def test_image_ids_with_a_trailing_newline_are_refused(tmp_path) -> None:
    (tmp_path / f"{IMAGE_ID}\n.png").write_bytes(b"x")  # a legal file name on Linux
    (tmp_path / f"{IMAGE_ID}.png").write_bytes(b"x")
    assert find_image(tmp_path, IMAGE_ID + "\n") is None
    assert find_image(tmp_path, IMAGE_ID) == tmp_path / f"{IMAGE_ID}.png"


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_expire_and_partial_cleanup_touch_only_url_images(tmp_path) -> None:
    old, new = tmp_path / f"{IMAGE_ID}.png", tmp_path / f"{'cd' * 16}-1.webp"
    partial = tmp_path / f".{'ef' * 16}-0.jpeg.partial"
    others = [tmp_path / "notes.png", tmp_path / ".other.partial", tmp_path / "video_jobs.sqlite3"]
    for path in (old, new, partial, *others):
        path.write_bytes(b"x")
    age(old, 100)
    assert expire_images(tmp_path, ttl=50) == 1
    assert remove_partial_images(tmp_path) == 1
    assert not old.exists() and not partial.exists() and new.exists()
    assert all(path.exists() for path in others)
    assert (
        expire_images(tmp_path / "missing", ttl=1) == 0 and remove_partial_images(tmp_path / "missing") == 0
    )
    assert sweep_interval(86400) == 60 and sweep_interval(1) == 0.5


def test_url_images_expire_after_job_ttl(tmp_path, monkeypatch) -> None:
    # A TTL well above a loaded machine's pauses: a file written by the test is never swept before the
    # test ages it on purpose (the sweeper runs every TTL / 4 = 1.25 s).
    app, engine, out = make_app(tmp_path, monkeypatch, job_ttl=5)
    stale, partial = out / f"{IMAGE_ID}.png", out / f".{'cd' * 16}-0.png.partial"
    stale.write_bytes(b"x")
    partial.write_bytes(b"x")
    age(stale, 10)

    async def scenario():
        async with app.router.lifespan_context(app):
            assert not stale.exists() and not partial.exists()  # at start
            fresh = out / f"{'12' * 16}-0.png"
            fresh.write_bytes(b"fresh")
            status, _, body = await call(app, "GET", f"/v1/images/{fresh.stem}/content")
            assert status == 200 and body == b"fresh"
            age(fresh, 10)  # past the TTL, before the sweeper ran: refused on access, and deleted
            status, _, body = await call(app, "GET", f"/v1/images/{fresh.stem}/content")
            assert status == 404 and error_of(body)["code"] == "image_not_found"
            assert not fresh.exists()
            swept = out / f"{'34' * 16}-0.png"
            swept.write_bytes(b"x")
            age(swept, 10)
            deadline = time.monotonic() + 10
            while swept.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not swept.exists()  # by the background sweeper

    asyncio.run(scenario())


# -- Range errors ----------------------------------------------------------------------------------


def test_range_errors_are_openai_json(tmp_path, monkeypatch) -> None:
    app, engine, out = make_app(tmp_path, monkeypatch)
    (out / f"{IMAGE_ID}.png").write_bytes(b"0123456789")
    path = f"/v1/images/{IMAGE_ID}/content"

    async def scenario():
        async with app.router.lifespan_context(app):
            status, headers, body = await call(app, "GET", path, {"Range": "bytes=100-200"})
            assert status == 416 and headers["content-range"] == "bytes */10"
            assert headers["content-type"] == "application/json"
            error = error_of(body)
            assert error["code"] == "range_not_satisfiable" and error["type"] == "invalid_request_error"
            status, headers, body = await call(app, "GET", path, {"Range": "items=0-1"})
            assert status == 400 and error_of(body)["code"] == "invalid_range"
            status, headers, body = await call(app, "GET", path, {"Range": "bytes=2-4"})
            assert status == 206 and body == b"234" and headers["content-range"] == "bytes 2-4/10"
            status, _, body = await call(app, "GET", path)
            assert status == 200 and body == b"0123456789"

    asyncio.run(scenario())


def test_content_file_response_ignores_a_stale_if_range(tmp_path) -> None:
    f = tmp_path / "a.mp4"
    f.write_bytes(b"0123456789")

    async def scenario():
        app = ContentFileResponse(f, media_type="video/mp4")
        status, _, body = await call(app, "GET", "/", {"Range": "bytes=100-", "If-Range": '"stale"'})
        assert status == 200 and body == b"0123456789"  # If-Range mismatch: the whole file, as Starlette

    asyncio.run(scenario())


# -- the openai client -----------------------------------------------------------------------------


def test_openai_client_url_images_with_api_key(tmp_path, monkeypatch) -> None:
    class AutoEngine(FakeEngineClient):
        auto_finish = True

    app, engine, out = make_app(tmp_path, monkeypatch, engine_cls=AutoEngine, api_key=API_KEY)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                client = openai.AsyncOpenAI(base_url="http://t/v1", api_key=API_KEY, http_client=http)
                result = await client.images.generate(prompt="a fox", response_format="url", n=2)
                assert len(result.data) == 2
                for image in result.data:
                    r = await http.get(image.url)  # the ?token= in the url, no header
                    assert r.status_code == 200 and r.content == b"\x89PNG fake"
                    r = await http.get(image.url, headers={"Range": "bytes=50-"})
                    assert r.status_code == 416 and r.json()["error"]["code"] == "range_not_satisfiable"
                b64 = await client.images.generate(prompt="a fox")
                assert b64.data[0].b64_json
                with contextlib.suppress(Exception):
                    await client.close()

    asyncio.run(scenario())


def test_public_url_builds_the_image_links_and_usage_is_zeros(tmp_path, monkeypatch) -> None:
    """--public-url: links use the address clients reach (not the request's Host header, which a proxy
    or a client sets); the plain response carries `usage` zeros as the streamed completed event does."""

    class AutoEngine(FakeEngineClient):
        auto_finish = True

    public = "https://img.example.com/diffserve"
    app, engine, out = make_app(tmp_path, monkeypatch, engine_cls=AutoEngine, public_url=public)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://internal:30000") as http:
                body = {"prompt": "a fox", "response_format": "url"}
                r = await http.post("/v1/images/generations", json=body, headers={"Host": "evil.example"})
                assert r.status_code == 200, r.text
                (image,) = r.json()["data"]
                assert image["url"].startswith(f"{public}/v1/images/") and image["url"].endswith("/content")
                assert r.json()["usage"]["total_tokens"] == 0
                # The file itself is served under the path the link names (the prefix is the proxy's).
                path = image["url"].removeprefix(public)
                assert (await http.get(path)).content == b"\x89PNG fake"

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("value", "ok"),
    [("https://img.example.com/", "https://img.example.com"), ("http://10.0.0.2:8080/p", "http://10.0.0.2:8080/p"),
     ("img.example.com", None), ("ftp://x", None), ("https://x/?a=1", None), ("https://", None)],
)  # fmt: skip
def test_public_url_flag_is_checked(value: str, ok: str | None) -> None:
    from diffserve.cli.serve import _checked_public_url
    from diffserve.errors import UserError

    if ok is not None:
        assert _checked_public_url(value) == ok
    else:
        with pytest.raises(UserError, match="--public-url must be an http"):
            _checked_public_url(value)
