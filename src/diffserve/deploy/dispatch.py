"""Several models at one address: an ASGI app in front of one diffserve app per model (server/app.py).

Each model keeps its own app (its routes, middleware, metrics, video jobs, LoRA state), exactly the
single server's; this layer only chooses which app answers:

- `POST /v1/images/generations`, `/v1/images/edits`, `/v1/videos`: the body's `model` (JSON, or the
  multipart field), matched against each model's ids (its name, path and folder name, as the single
  server's `model` check); an unknown one is a 404 naming the served models; none names the default
  model, the first listed (as a single server takes a request without `model`). The body is read here
  first, up to the route's size limit (413 past it), then handed to the model's app unchanged.
- `/v1/videos/{id}...` and `/v1/images/{id}/content`: the model whose job store or output folder has it;
  `GET /v1/videos` and the LoRA routes: the model named by the query parameter `?model=` (the LoRA
  routes need it; the video list defaults to the first video model).
- merged: `GET /v1/models` (every model), `GET /v1/models/{id}` (the model with that id), `/health` (200
  when every model has a ready replica, else the first 503), `/health_generate` (a probe per model),
  `/server_info` (the default model's answer, as a single server's, and every model's under `models`)
  and `/metrics` (every model's samples, labelled `model`).
- anything else (the playground, /docs): the default model's app.

Requests are checked for the API key here too, so nothing is answered to a caller without one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diffserve.server.app_state import AppState, app_state_of
from diffserve.server.errors import error_response
from diffserve.server.image_files import find_image
from diffserve.server.middleware import ApiKeyMiddleware
from diffserve.server.video_jobs import VIDEO_ID_PATTERN

#: The routes whose body names the model.
BODY_ROUTES = ("/v1/images/generations", "/v1/images/edits", "/v1/videos")

Answer = tuple[int, dict[str, str], bytes]


class ModelDispatcher:
    """One address for several models' apps (module docstring). `apps`: model id -> app, the default
    model first."""

    def __init__(self, apps: Mapping[str, FastAPI]) -> None:
        self.apps = dict(apps)
        self.states: dict[str, AppState] = {name: app_state_of(app) for name, app in self.apps.items()}
        self.default = next(iter(self.apps))
        args = self.states[self.default].args
        self._route: ASGIApp = self._dispatch
        if args.api_key or args.admin_api_key:
            self._route = ApiKeyMiddleware(
                self._dispatch, api_key=args.api_key, admin_api_key=args.admin_api_key
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._route(scope, receive, send)
        else:
            await self.apps[self.default](scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Start every model's app (its lifespan) at startup, stop them all at shutdown."""
        async with AsyncExitStack() as stack:
            message = await receive()
            assert message["type"] == "lifespan.startup"
            try:
                for app in self.apps.values():
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as exc:
                await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                return
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})

    # -- choosing the app --------------------------------------------------------------------------
    def model_of(self, name: str) -> str | None:
        """The served model `name` is an id of (its name, path or folder name), or None."""
        return next((model for model, state in self.states.items() if name in state.args.model_aliases), None)

    def unknown(self, name: str) -> Response:
        served = ", ".join(repr(model) for model in self.apps)
        message = f"model {name!r} is not served here; this server serves {served}"
        return error_response(404, message, "model", "model_not_found")

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        handler: Callable[[], Awaitable[Response | None]] | None = None
        if method == "POST" and path in BODY_ROUTES:
            await self._by_body(scope, receive, send)
            return
        if path == "/v1/models" and method == "GET":
            handler = lambda: self._models(scope)  # noqa: E731
        elif path.startswith("/v1/models/") and method == "GET":
            name = path.removeprefix("/v1/models/")
            model = self.model_of(name)
            if model is None:
                await self.unknown(name)(scope, receive, send)
                return
            await self.apps[model](scope, receive, send)
            return
        elif path in ("/health", "/health_generate", "/server_info", "/metrics"):
            handler = {"/health": lambda: self._health(scope), "/health_generate": lambda: self._probes(scope),
                       "/server_info": lambda: self._server_info(scope), "/metrics": lambda: self._metrics(scope)}[path]  # fmt: skip
        if handler is not None:
            answer = await handler()
            assert answer is not None
            await answer(scope, receive, send)
            return
        model = self._model_by_path(path, query)
        if isinstance(model, Response):
            await model(scope, receive, send)
            return
        await self.apps[model](scope, receive, send)

    def _model_by_path(self, path: str, query: dict[str, str]) -> str | Response:
        """The model of a route that names no model in its body (module docstring)."""
        if "model" in query:
            model = self.model_of(query["model"])
            return model if model is not None else self.unknown(query["model"])
        if path == "/v1/loras" or path.startswith("/v1/loras/"):
            served = ", ".join(repr(model) for model in self.apps)
            message = f"this server serves several models ({served}): name the one with ?model="
            return error_response(400, message, "model", "model_required")
        parts = path.split("/")
        if path.startswith("/v1/videos/") and len(parts) > 3 and VIDEO_ID_PATTERN.match(parts[3]):
            for model, state in self.states.items():
                if state.video_jobs.is_open and state.video_jobs.get(parts[3]) is not None:
                    return model
        if path == "/v1/videos":
            return next((m for m, s in self.states.items() if s.video_jobs.is_open), self.default)
        if path.startswith("/v1/images/") and path.endswith("/content") and len(parts) == 5:
            for model, state in self.states.items():
                if find_image(state.args.output_dir, parts[3]) is not None:
                    return model
        return self.default

    async def _by_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (bounded), find its `model`, and hand the request to that model's app."""
        args = self.states[self.default].args
        limit = {"/v1/images/edits": args.max_edit_body_bytes, "/v1/videos": args.max_video_body_bytes}.get(
            scope["path"], args.max_body_bytes
        )
        body = await read_bounded(receive, limit)
        if body is None:
            message = f"request body exceeds this server's limit of {limit} bytes for {scope['path']}"
            await error_response(413, message, None, "request_too_large")(scope, receive, send)
            return
        name = await body_model(scope, body)
        model = self.default if name is None else self.model_of(name)
        if model is None:
            await self.unknown(str(name))(scope, receive, send)
            return
        await self.apps[model](scope, replay(body, receive), send)

    # -- merged answers ----------------------------------------------------------------------------
    async def _each(self, scope: Scope, path: str) -> dict[str, Answer]:
        """Every model's app's answer to GET `path` (with the caller's headers)."""
        answers = await asyncio.gather(*(call_app(app, scope, path) for app in self.apps.values()))
        return dict(zip(self.apps, answers, strict=True))

    async def _models(self, scope: Scope) -> Response:
        answers = await self._each(scope, "/v1/models")
        data: list[Any] = []
        for status, headers, body in answers.values():
            if status != 200:
                return Response(body, status, headers)
            data.extend(json.loads(body)["data"])
        return JSONResponse({"object": "list", "data": data})

    async def _health(self, scope: Scope) -> Response:
        for status, headers, body in (await self._each(scope, "/health")).values():
            if status != 200:
                return Response(body, status, headers)
        return JSONResponse({"status": "ok"})

    async def _probes(self, scope: Scope) -> Response:
        answers = await self._each(scope, "/health_generate")
        bodies = {model: json.loads(body) for model, (_, _, body) in answers.items()}
        status = max(answer[0] for answer in answers.values())
        return JSONResponse({"status": "ok" if status == 200 else "failed", "models": bodies}, status)

    async def _server_info(self, scope: Scope) -> Response:
        answers = await self._each(scope, "/server_info")
        status, headers, body = answers[self.default]
        if status != 200:
            return Response(body, status, headers)
        infos = {model: json.loads(answer[2]) for model, answer in answers.items()}
        return JSONResponse({**infos[self.default], "models": infos})

    async def _metrics(self, scope: Scope) -> Response:
        answers = await self._each(scope, "/metrics")
        texts = {model: body.decode() for model, (_, _, body) in answers.items()}
        return Response(labelled_metrics(texts), media_type=CONTENT_TYPE_LATEST)


def labelled_metrics(texts: Mapping[str, str]) -> bytes:
    """Several Prometheus expositions as one, each sample labelled with its `model`."""
    families: dict[str, Metric] = {}
    for model, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                labels = {**sample.labels, "model": model}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)

    class Collected:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(Collected())  # type: ignore[arg-type]
    return generate_latest(registry)


async def read_bounded(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None once it exceeds `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` once, then the client's own messages (its disconnect)."""
    sent = False

    async def receive_again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


async def body_model(scope: Scope, body: bytes) -> str | None:
    """The `model` a JSON or multipart body names (None: none, or a body the model's app will refuse)."""
    content_type = Request(scope).headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        request = Request(scope, replay(body, _no_more))
        try:
            form = await request.form(max_files=10_000, max_fields=10_000)
        except Exception:
            return None
        try:
            value = form.get("model")
            return value if isinstance(value, str) and value else None
        finally:
            await form.close()
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    value = parsed.get("model") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else None


async def _no_more() -> Message:
    return {"type": "http.disconnect"}


async def call_app(app: ASGIApp, scope: Scope, path: str) -> Answer:
    """`app`'s answer to GET `path` with the headers of the request in `scope` (an in-process call)."""
    inner: Scope = {**scope, "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b""}
    status, headers, chunks = 500, {}, []
    asked, answered = False, asyncio.Event()

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await answered.wait()  # the caller "leaves" only once the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    await app(inner, receive, send)
    headers.pop("content-length", None)
    return status, headers, b"".join(chunks)
