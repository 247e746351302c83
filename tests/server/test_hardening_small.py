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
