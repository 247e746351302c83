"""Regression tests of issue 17's smaller front-end defects, on the real middleware and helpers (no engine):
metrics label cardinality, log injection, API-key whitespace, id patterns, multipart errors' outcome."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffserve.configs.engine_args import EngineArgs
from diffserve.server.app_state import outcome_of
from diffserve.server.args import ServerArgs
from diffserve.server.errors import as_api_error, install_error_handlers
from diffserve.server.metrics import ServerMetrics
from diffserve.server.middleware import (
    ApiKeyMiddleware,
    RequestContextMiddleware,
    content_token,
)
from diffserve.server.request_body import read_body
from diffserve.server.schemas import ImageGenerationRequest
from diffserve.server.video_jobs import VIDEO_ID_PATTERN

API_KEY = "s3cret-key"


def make_app(metrics: ServerMetrics, api_key: str | None = None) -> tuple[FastAPI, list[str]]:
    """A tiny app behind the server's own middleware stack; `outcomes` records what outcome_of labels."""
    app = FastAPI()
    install_error_handlers(app)
    outcomes: list[str] = []

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": []}

    @app.post("/v1/form")
    async def form(request: Request) -> dict:
        try:
            await read_body(
                request,
                ImageGenerationRequest,
                ("prompt",),
                ("image",),
                None,
                empty="empty",
                send="multipart",
            )
        except Exception as exc:
            outcomes.append(outcome_of(exc))
            raise
        return {}

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app, outcomes


def http_request_samples(metrics: ServerMetrics) -> list[dict[str, str]]:
    return [
        s.labels
        for family in metrics.registry.collect()
        if family.name == "diffserve_http_requests"
        for s in family.samples
        if s.name.endswith("_total")
    ]


def test_unknown_methods_and_routes_share_one_label() -> None:
    metrics = ServerMetrics()
    app, _ = make_app(metrics, api_key=API_KEY)
    with TestClient(app) as client:
        for i in range(200):  # unauthenticated noise: random methods on random paths
            client.request(f"M{i}X", f"/nowhere/{i}")
            client.request(f"Q{i}", "/v1/models")
        client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    labels = http_request_samples(metrics)
    assert {s["method"] for s in labels} == {"other", "GET"}
    assert {s["route"] for s in labels} <= {"unmatched", "/v1/models"}
    assert len(labels) <= 4, labels  # bounded, whatever the noise
    size = len(metrics.render())
    assert size < 20_000, size


def test_access_log_escapes_control_characters(caplog: pytest.LogCaptureFixture) -> None:
    app, _ = make_app(ServerMetrics())
    with caplog.at_level(logging.INFO, logger="diffserve.access"), TestClient(app) as client:
        client.get("/v1/models%0a1234 GET /admin 200 0.001s client=1.2.3.4:5%0d%1b[31m")
    lines = [r.getMessage() for r in caplog.records if r.name == "diffserve.access"]
    assert len(lines) == 1
    line = lines[0]
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "/v1/models\\x0a1234 GET /admin" in line and "\\x0d\\x1b[31m" in line


def test_loggable_escapes_and_bounds() -> None:
    from diffserve.server.middleware import loggable

    assert loggable("/a\nb") == "/a\\x0ab"
    assert loggable("a\\x0ab") == "a\\\\x0ab"  # a backslash the client sent cannot pose as an escape
    assert loggable("x\u2028y\x85z\x7f") == "x\\u2028y\\x85z\\x7f"
    assert loggable("/caf\u00e9") == "/caf\u00e9"  # printable text stays readable
    long = loggable("/" + "a" * 10_000)
    assert len(long) < 1_100 and long.endswith("more)")


def test_api_key_with_surrounding_whitespace_matches() -> None:
    app, _ = make_app(ServerMetrics(), api_key=f"  {API_KEY}\n")
    with TestClient(app) as client:
        ok = client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
        bad = client.get("/v1/models", headers={"Authorization": "Bearer "})
        assert bad.status_code == 401
    # image URLs' tokens are signed with the same, stripped, key
    assert content_token(f" {API_KEY}\n", "abc") == content_token(API_KEY, "abc")


def test_blank_api_key_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        ApiKeyMiddleware(FastAPI(), api_key=" \n")


def test_video_id_pattern_refuses_a_trailing_newline() -> None:
    good = "video_" + "0123456789abcdef" * 2
    assert VIDEO_ID_PATTERN.match(good)
    for bad in (good + "\n", good + "0", "x" + good, good[:-1], good.upper()):
        assert not VIDEO_ID_PATTERN.match(bad), repr(bad)


def test_malformed_multipart_is_a_client_error_not_a_failure() -> None:
    app, outcomes = make_app(ServerMetrics())
    broken = (
        b"--XYZ\r\nContent-Disposition: form-data\r\n\r\nhello\r\n--XYZ--\r\n",  # a part without a name
        b"--XYZ\r\nNoColonHeader\r\n\r\nhello\r\n--XYZ--\r\n",  # a malformed part header
    )
    with TestClient(app) as client:
        for body in broken:
            headers = {"Content-Type": "multipart/form-data; boundary=XYZ"}
            response = client.post("/v1/form", content=body, headers=headers)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["type"] == "invalid_request_error"
            assert response.json()["error"]["code"] == "invalid_request"
    assert outcomes == ["invalid", "invalid"]


def test_http_exceptions_keep_their_status() -> None:
    error = as_api_error(StarletteHTTPException(413, "request body of more than 10 bytes exceeds the limit"))
    assert (error.status, error.code) == (413, "request_too_large")
    assert outcome_of(StarletteHTTPException(400, "bad multipart")) == "invalid"
    assert outcome_of(RuntimeError("boom")) == "failed"


@pytest.mark.parametrize(
    ("model_path", "served", "expected"),
    [
        ("/opt/models/shapes-demo", [], "shapes-demo"),
        ("/opt/models/FLUX.1-dev/", [], "FLUX.1-dev"),
        ("black-forest-labs/FLUX.1-dev", [], "FLUX.1-dev"),  # a hub repo id: its name
        ("/opt/models/shapes-demo", ["demo", "alias"], "demo"),
    ],
)
def test_the_model_id_is_a_name_not_a_path_of_the_server(model_path, served, expected) -> None:
    args = ServerArgs(EngineArgs(model_path=model_path), served_model_names=served)
    assert args.model_id == expected
    assert {expected, model_path} <= args.model_aliases  # the path itself is still accepted as `model`


def test_a_stalled_body_gets_408_and_a_finished_one_waits_freely(monkeypatch) -> None:
    """BodySizeLimitMiddleware: a body that stops arriving is answered 408 after BODY_IDLE_TIMEOUT_S;
    once the body is complete, later receives (waiting for a disconnect) have no deadline."""
    import asyncio

    from diffserve.server import middleware

    monkeypatch.setattr(middleware, "BODY_IDLE_TIMEOUT_S", 0.2)
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    stack = middleware.BodySizeLimitMiddleware(app, max_bytes=1000)

    async def call(chunks: list[bytes], stall_after: bool) -> tuple[int, bytes]:
        pending = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
        if not stall_after:
            pending[-1]["more_body"] = False
        sent: list[dict] = []

        async def receive() -> dict:
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)  # a stalled client
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/echo", "headers": [], "query_string": b"",
                 "http_version": "1.1", "scheme": "http", "server": ("t", 80), "root_path": ""}  # fmt: skip
        await asyncio.wait_for(stack(scope, receive, send), 5)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], body

    status, body = asyncio.run(call([b'{"a": "', b"xx"], stall_after=True))
    assert status == 408 and b"request body stalled" in body and b"request_timeout" in body
    assert asyncio.run(call([b"12", b"345"], stall_after=False)) == (200, b'{"size":5}')


# --- issue 31 items 13, 18, 19: keys and ownership, server paths, the output-folder lock, log floods ------

CLIENT_A, CLIENT_B, ADMIN_KEY = "client-a-key", "client-b-key", "admin-key-0"
SERVER_ROOT = "/srv/diffserve-test"  # a made-up server folder: the model, --lora-dir and outputs under it
VIDEO_INFO = {
    "task": "text-to-video",
    "diffusers_pipeline": "WanPipeline",
    "video": {"temporal_factor": 4, "max_frames": 81, "max_fps": 120},
    "default_params": {"fps": 16},
}


class FakeVideoEngine:
    """Accepts every video job and keeps it running until cancelled; answers LoRA ops like an engine with
    --lora-dir SERVER_ROOT/loras."""

    ready = True
    engine_info = VIDEO_INFO

    def __init__(self) -> None:
        self.outcomes: dict = {}
        self.lora_ops: list[str] = []

    async def submit(self, job, on_event):
        import asyncio

        from diffserve.server.protocol import JobAccepted

        outcome = asyncio.get_running_loop().create_future()
        self.outcomes[job.request_id] = outcome
        return JobAccepted(job.request_id, job.params), outcome

    def cancel(self, request_id: str) -> bool:
        from diffserve.server.engine_client import JobCancelledError

        outcome = self.outcomes.get(request_id)
        if outcome is not None and not outcome.done():
            outcome.set_exception(JobCancelledError(None))
        return True

    def adapter(self, name: str) -> dict:
        return {"name": name, "path": f"{SERVER_ROOT}/loras/{name}.safetensors", "family": "wan",
                "format": "diffusers", "rank": 4, "bytes": 0, "targets": 1, "resident": True, "in_use": 0}  # fmt: skip

    async def load_lora(self, name: str, path: str, strict: bool = True):
        from types import SimpleNamespace

        self.lora_ops.append(f"load {name}")
        return SimpleNamespace(adapter=self.adapter(name))

    async def unload_lora(self, name: str):
        from types import SimpleNamespace

        self.lora_ops.append(f"unload {name}")
        return SimpleNamespace(adapter=None)

    async def list_loras(self):
        from types import SimpleNamespace

        loras = {"adapters": [self.adapter("ink")], "merged": [], "resident_bytes": 0, "max_lora_memory": 0,
                 "lora_dir": f"{SERVER_ROOT}/loras"}  # fmt: skip
        return SimpleNamespace(loras=loras)


def keyed_app(tmp_path, **keys: str):
    """The server's own middleware stack (app.add_middleware) over the video and LoRA routes and a route
    showing server paths, on FakeVideoEngine; `keys`: ServerArgs' api_key / admin_api_key."""
    from contextlib import asynccontextmanager

    from diffserve.server import lora_routes, video_routes
    from diffserve.server.app import add_middleware
    from diffserve.server.app_state import AppState, set_app_state
    from diffserve.server.health_probe import HealthProbe
    from diffserve.server.video_jobs import VideoJobManager

    engine = FakeVideoEngine()
    metrics = ServerMetrics()
    model = f"{SERVER_ROOT}/models/tiny-wan"
    args = ServerArgs(EngineArgs(model_path=model, output_path=str(tmp_path / "out")), **keys)
    args.engine_args.lora_dir = f"{SERVER_ROOT}/loras"
    jobs = VideoJobManager(args.output_dir, 3600.0, engine, metrics)  # type: ignore[arg-type]

    @asynccontextmanager
    async def lifespan(app):
        jobs.open()
        yield
        for request_id in engine.outcomes:  # the engine stops: what still runs is cancelled
            engine.cancel(request_id)
        await jobs.close()

    app = FastAPI(lifespan=lifespan)
    set_app_state(app, AppState(args, engine, metrics, jobs, HealthProbe(engine, 1.0, 1.0), started_at=0))
    install_error_handlers(app)
    add_middleware(app, args, metrics)
    app.include_router(video_routes.router)
    app.include_router(lora_routes.router)

    @app.get("/paths")
    async def paths() -> dict:
        import sys

        return {"model_path": model, "lora_dir": f"{SERVER_ROOT}/loras", "python_executable": sys.executable,
                "message": f"could not read {SERVER_ROOT}/loras/styles/ink.safetensors: bad header",
                "note": "routes such as /v1/videos stay as they are"}  # fmt: skip

    @app.get("/events")
    async def events():
        from fastapi.responses import StreamingResponse

        async def stream():
            lora = f"{SERVER_ROOT}/loras/ink.safetensors"
            yield f'event: error\ndata: {{"message": "LoRA ({lora}) does not fit"}}\n\n'

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app, engine


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_a_client_key_sees_only_its_own_video_jobs(tmp_path) -> None:
    app, _ = keyed_app(tmp_path, api_key=f"{CLIENT_A},{CLIENT_B}", admin_api_key=ADMIN_KEY)
    with TestClient(app) as client:
        fox, owl = {"prompt": "a fox", "size": "32x32"}, {"prompt": "an owl", "size": "32x32"}
        created = client.post("/v1/videos", json=fox, headers=bearer(CLIENT_A))
        assert created.status_code == 200, created.text
        video_id = created.json()["id"]
        assert "owner" not in created.json()  # the owner is never shown
        theirs = client.post("/v1/videos", json=owl, headers=bearer(CLIENT_B))
        other_id = theirs.json()["id"]
        # another client: the job does not exist for it
        for method, path in [("GET", f"/v1/videos/{video_id}"), ("GET", f"/v1/videos/{video_id}/content"),
                             ("DELETE", f"/v1/videos/{video_id}")]:  # fmt: skip
            r = client.request(method, path, headers=bearer(CLIENT_B))
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "video_not_found"
        listed = client.get("/v1/videos", headers=bearer(CLIENT_B)).json()["data"]
        assert [job["id"] for job in listed] == [other_id]
        r = client.get(f"/v1/videos?after={video_id}", headers=bearer(CLIENT_B))
        assert r.status_code == 400, r.text  # no paging through it either
        # its owner sees it (and it still runs: B's DELETE did nothing)
        assert client.get(f"/v1/videos/{video_id}", headers=bearer(CLIENT_A)).json()["status"] == "queued"
        assert client.get(f"/v1/videos/{video_id}/content", headers=bearer(CLIENT_A)).status_code == 409
        mine = client.get("/v1/videos", headers=bearer(CLIENT_A)).json()["data"]
        assert [job["id"] for job in mine] == [video_id]
        # the admin key sees every client's jobs
        everyone = client.get("/v1/videos", headers=bearer(ADMIN_KEY)).json()["data"]
        assert {job["id"] for job in everyone} == {video_id, other_id}
        assert client.delete(f"/v1/videos/{video_id}", headers=bearer(CLIENT_A)).status_code == 200
        assert client.get(f"/v1/videos/{video_id}", headers=bearer(CLIENT_A)).json()["status"] == "cancelled"
        assert client.delete(f"/v1/videos/{other_id}", headers=bearer(ADMIN_KEY)).status_code == 200


def test_without_keys_every_caller_sees_every_job_as_before(tmp_path) -> None:
    app, _ = keyed_app(tmp_path)
    with TestClient(app) as client:
        video_id = client.post("/v1/videos", json={"prompt": "a fox", "size": "32x32"}).json()["id"]
        assert client.get(f"/v1/videos/{video_id}", headers=bearer("anything")).status_code == 200
        assert [job["id"] for job in client.get("/v1/videos").json()["data"]] == [video_id]
        assert client.post("/v1/loras", json={"name": "ink", "path": "ink.safetensors"}).status_code == 200
        assert client.get("/paths").json()["model_path"] == f"{SERVER_ROOT}/models/tiny-wan"


def test_jobs_of_a_store_from_before_owners_stay_readable(tmp_path) -> None:
    """A store written before jobs had owners gets the column; its jobs belong to no client (admins')."""
    import sqlite3

    from diffserve.server.video_jobs import VideoJobStore

    path = tmp_path / "video_jobs.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE videos (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, status TEXT NOT "
        "NULL, progress INTEGER NOT NULL, phase TEXT NOT NULL, created_at REAL NOT NULL, completed_at REAL, "
        "error_code TEXT, error_message TEXT, file_bytes INTEGER, details TEXT NOT NULL);"
        "INSERT INTO videos (id, status, progress, phase, created_at, details) VALUES "
        "('video_old', 'completed', 100, 'completed', 1.0, '{\"model\": \"m\", \"prompt\": \"p\"}');"
    )
    db.close()
    store = VideoJobStore(path)
    try:
        assert store.get("video_old").owner == ""
        assert [job.id for job in store.page(10, None, True, owners={"", "key:x"})[0]] == ["video_old"]
        assert store.page(10, None, True, owners={"key:x"})[0] == []
    finally:
        store.close()


def test_admin_routes_need_the_admin_key(tmp_path) -> None:
    app, engine = keyed_app(tmp_path, api_key=CLIENT_A, admin_api_key=ADMIN_KEY)
    load = {"name": "ink", "path": "ink.safetensors"}
    with TestClient(app) as client:
        r = client.post("/v1/loras", json=load, headers=bearer(CLIENT_A))
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["code"] == "admin_key_required" and error["type"] == "permission_error", error
        assert client.delete("/v1/loras/ink", headers=bearer(CLIENT_A)).status_code == 403
        assert client.post("/v1/loras", json=load).status_code == 401
        assert engine.lora_ops == []  # nothing reached the engine
        assert client.post("/v1/loras", json=load, headers=bearer(ADMIN_KEY)).status_code == 200
        assert client.delete("/v1/loras/ink", headers=bearer(ADMIN_KEY)).status_code == 200
        assert engine.lora_ops == ["load ink", "unload ink"]
        assert client.get("/v1/loras", headers=bearer(CLIENT_A)).status_code == 200  # listing stays open


def test_with_an_admin_key_only_anonymous_callers_keep_the_rest(tmp_path) -> None:
    app, engine = keyed_app(tmp_path, admin_api_key=ADMIN_KEY)
    with TestClient(app) as client:
        video_id = client.post("/v1/videos", json={"prompt": "a fox", "size": "32x32"}).json()["id"]
        assert client.get(f"/v1/videos/{video_id}", headers=bearer("sk-dummy")).status_code == 200
        assert client.post("/v1/loras", json={"name": "ink", "path": "ink.safetensors"}).status_code == 401
        assert client.get("/v1/videos", headers=bearer(ADMIN_KEY)).json()["data"][0]["id"] == video_id
    assert engine.lora_ops == []


def test_without_an_admin_key_client_keys_keep_the_admin_routes(tmp_path) -> None:
    app, engine = keyed_app(tmp_path, api_key=CLIENT_A)
    with TestClient(app) as client:
        load = {"name": "ink", "path": "ink.safetensors"}
        r = client.post("/v1/loras", json=load, headers=bearer(CLIENT_A))
        assert r.status_code == 200, r.text
        assert r.json()["path"].startswith(SERVER_ROOT)  # no admin key: every key holder is an admin
    assert engine.lora_ops == ["load ink"]


def test_responses_to_non_admins_carry_no_server_paths(tmp_path) -> None:
    import json
    import sys

    app, _ = keyed_app(tmp_path, api_key=CLIENT_A, admin_api_key=ADMIN_KEY)
    with TestClient(app) as client:
        seen = {}
        for key in (CLIENT_A, None):
            for path in ("/paths", "/v1/loras"):
                r = client.get(path, headers=bearer(key))
                if key is None:
                    assert r.status_code == 401
                    continue
                assert r.status_code == 200, r.text
                assert int(r.headers["content-length"]) == len(r.content)
                seen[path] = r.json()
                text = json.dumps(r.json())
                for secret in (SERVER_ROOT, sys.executable, sys.prefix, str(tmp_path)):
                    assert secret not in text, (path, secret, text)
        shown = seen["/paths"]
        assert shown["model_path"] == "tiny-wan" and shown["lora_dir"] == "loras"
        assert shown["python_executable"] == sys.executable.rsplit("/", 1)[1]
        # relative to --lora-dir
        assert shown["message"] == "could not read styles/ink.safetensors: bad header"
        assert shown["note"] == "routes such as /v1/videos stay as they are"
        assert seen["/v1/loras"]["data"][0]["path"] == "ink.safetensors"
        events = client.get("/events", headers=bearer(CLIENT_A)).text  # a stream's error event too
        assert SERVER_ROOT not in events and "LoRA (ink.safetensors) does not fit" in events, events
        # the admin sees them
        admin = client.get("/paths", headers=bearer(ADMIN_KEY)).json()
        assert admin["model_path"] == f"{SERVER_ROOT}/models/tiny-wan"
        assert admin["python_executable"] == sys.executable


def test_the_admin_key_must_differ_from_client_keys() -> None:
    from diffserve.errors import UserError

    with pytest.raises(UserError, match="must differ"):
        ServerArgs(EngineArgs(model_path="/m"), api_key=f"{CLIENT_A},{CLIENT_B}", admin_api_key=CLIENT_B)
    info = ServerArgs(EngineArgs(model_path="/m"), api_key=f"{CLIENT_A},{CLIENT_B}", admin_api_key=ADMIN_KEY)
    shown = info.to_dict()
    assert (shown["api_key"], shown["admin_api_key"]) == ("set (2 keys)", "set")
    assert CLIENT_A not in str(shown) and ADMIN_KEY not in str(shown)


def test_a_second_server_cannot_lock_the_same_output_folder(tmp_path) -> None:
    """Item 18: the lock of --output-path, held by another process, is refused naming that process; once
    it exits (even killed), the folder can be locked again."""
    import subprocess
    import sys

    from diffserve.errors import UserError
    from diffserve.server.output_lock import OutputDirLock

    folder = tmp_path / "outputs"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from diffserve.server.output_lock import OutputDirLock; OutputDirLock.acquire(Path(sys.argv[1])); "
         "print('locked', flush=True); time.sleep(600)", str(folder)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"in use by another diffserve server \(pid {holder.pid}\)"):
            OutputDirLock.acquire(folder)
    finally:
        holder.kill()
        holder.wait(30)
    lock = OutputDirLock.acquire(folder)  # the kernel released the killed holder's lock
    try:
        with pytest.raises(UserError, match="in use"):
            OutputDirLock.acquire(folder)  # one holder per folder, this process included
    finally:
        lock.release()
    OutputDirLock.acquire(folder).release()


def test_out_of_descriptor_errors_are_logged_once_per_interval() -> None:
    """Item 13: asyncio logs every failed accept with its traceback; through ResourceErrorLogFilter a flood
    of them is one line per interval, without the traceback."""
    import errno
    import io

    from diffserve.server.connections import ResourceErrorLogFilter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ResourceErrorLogFilter(interval=3600))
    log = logging.getLogger("test.resource-errors")
    log.addHandler(handler)
    log.propagate = False
    try:
        for _ in range(5000):
            try:
                raise OSError(errno.EMFILE, "Too many open files")
            except OSError as exc:
                log.error("socket.accept() out of system resource", exc_info=exc)
        log.error("something else", exc_info=ValueError("kept"))
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert text.count("Too many open files") == 1 and "socket.accept() out of system resource" in text
    assert "ValueError: kept" in text  # other errors keep their exception
    assert len(text) < 2000, len(text)


def test_the_open_file_limit_is_raised_to_fit_the_connection_cap(monkeypatch) -> None:
    import resource

    from diffserve.server import connections

    limits = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits["soft"], limits["hard"]))

    def setrlimit(which, values):
        limits["soft"], limits["hard"] = values

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert connections.fit_connection_limit(1024) == 1024
    assert limits["soft"] == connections.fd_budget(1024) <= 4096
    limits.update(soft=1024, hard=1024)  # cannot be raised: the cap is lowered to what fits
    assert connections.fit_connection_limit(1024) == (1024 - connections.FD_RESERVE) // 2
