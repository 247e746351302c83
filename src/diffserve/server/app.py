"""The HTTP front end: FastAPI routes over the engine client; nothing here waits on model work.

The image routes turn a request (schemas.py; the edits body is read by image_edits.py) into a job for
the engine (engine_client.py) and answer OpenAI's ImagesResponse, or its server-sent events with
`"stream": true` (streaming.py). `/v1/videos` (video_routes.py) answers with a job at once and runs it
in the background (video_jobs.py). Each route refuses models of the other kind, naming the route to use.
`/v1/loras` (lora_routes.py) loads, lists and unloads the LoRA adapters requests name in `loras`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import platform
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

import diffserve
from diffserve.configs.sampling_params import SamplingParams
from diffserve.outputs import CONTENT_TYPES
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient, JobFailedError, JobRejectedError
from diffserve.server.errors import (
    ApiError,
    as_api_error,
    documented,
    error_body,
    error_response,
    install_error_handlers,
)
from diffserve.server.image_edits import EDIT_REQUEST_BODY, EditModel, read_edit_request
from diffserve.server.image_files import expire_images, find_image, remove_partial_images, sweep_images
from diffserve.server.lora_routes import live_lora_state, lora_router
from diffserve.server.metrics import ServerMetrics
from diffserve.server.middleware import (
    CLIENT_CLOSED_REQUEST,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestContextMiddleware,
    content_token,
)
from diffserve.server.protocol import GenerateJob, JobFinished
from diffserve.server.replicas import Engines, ReplicaSet
from diffserve.server.schemas import ImageGenerationRequest, ImagesResponse, ModelCard, ModelList
from diffserve.server.streaming import (
    ZERO_USAGE,
    ContentFileResponse,
    EventStreamResponse,
    StreamHeader,
    StreamKind,
    image_events,
    wait_for_disconnect,
)
from diffserve.server.video_jobs import VideoJobManager
from diffserve.server.video_routes import check_route, video_router

logger = logging.getLogger("diffserve.server")

HEALTH_GENERATE_TIMEOUT_S = 120.0
HEALTH_GENERATE_REUSE_S = 5.0  # /health_generate reuses the last probe's result this long
DESCRIPTION = "OpenAI-compatible image and video generation with diffserve"
T = TypeVar("T")

_ERRORS = documented(400, 401, 404, 413, 429, 500, 503)
#: The image routes answer JSON, or OpenAI's server-sent events (image_generation.*, image_edit.*) with "stream".
#: One server-sent event, as a client's event-stream parser yields it (the event's name and its JSON data).
_SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
_EVENTS = {"text/event-stream": {"schema": _SSE_EVENT}}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_IMAGE_FILE = {
    "description": "the image file",
    "content": {f"image/{kind}": _BINARY for kind in ("png", "jpeg", "webp")},
}
_IMAGE_OK = {"description": "ImagesResponse, or server-sent events", "content": _EVENTS}
_IMAGE_RESPONSES = {**_ERRORS, 200: _IMAGE_OK}


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) when the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


@dataclass(frozen=True)
class ProbeResult:
    """One /health_generate generation's answer, and when and on which engine it ran."""

    status: int
    body: dict[str, Any]
    finished_at: float  # time.monotonic()
    incarnation: int  # a restarted engine is probed afresh


class HealthProbe:
    """/health_generate's generation, rate-limited (the route is open): one in flight, shared by
    concurrent callers, reused for `reuse_s` s, queued like any job (429 when full), cancelled once no
    caller waits for it."""

    def __init__(self, engine: Engines, timeout_s: float, reuse_s: float) -> None:
        self.engine, self.timeout_s, self.reuse_s = engine, timeout_s, reuse_s
        self._task: asyncio.Task[ProbeResult] | None = None
        self._waiters = 0
        self._last: ProbeResult | None = None

    def recent(self) -> ProbeResult | None:
        last = self._last
        if last is None or not self.engine.ready or last.incarnation != self.engine.incarnation:
            return None
        return last if time.monotonic() - last.finished_at < self.reuse_s else None

    async def result(self, request: Request) -> tuple[ProbeResult, bool]:
        """The result and whether it was reused; raises ClientDisconnected, and the engine client's
        errors before queueing."""
        if (last := self.recent()) is not None:
            return last, True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(request.state.request_id))
        task = self._task
        self._waiters += 1
        try:
            return await run_unless_disconnected(request, asyncio.shield(task)), False
        finally:
            self._waiters -= 1
            if self._waiters == 0 and not task.done():
                logger.info("Cancelling the /health_generate probe: no caller is waiting for it anymore")
                task.cancel()  # engine.generate sends CancelJob
                if self._task is task:
                    self._task = None  # the next caller starts a new probe

    async def _run(self, request_id: str) -> ProbeResult:
        engine, size = self.engine, self.engine.probe_size
        params = SamplingParams(prompt="health check", height=size, width=size, num_inference_steps=1)
        job = GenerateJob(request_id, params, internal=True)
        incarnation, start = engine.incarnation, time.monotonic()
        try:
            result = await asyncio.wait_for(engine.generate(job), self.timeout_s)
        except asyncio.TimeoutError:
            message = f"the health-check generation did not finish in {self.timeout_s:g} s"
            status, body = 503, error_body(503, message, None, "health_check_timeout")
        except (JobFailedError, JobRejectedError) as exc:
            message = f"the health-check generation failed: {exc}"
            status, body = 503, error_body(503, message, None, "health_check_failed")
        else:
            seconds, engine_seconds = round(time.monotonic() - start, 4), round(result.engine_seconds, 4)
            body = {"status": "ok", "seconds": seconds, "engine_seconds": engine_seconds}
            status, body = 200, {**body, "size": f"{size}x{size}", "num_inference_steps": 1}
        self._last = ProbeResult(status, body, time.monotonic(), incarnation)
        return self._last


def outcome_of(exc: Exception) -> str:
    """The `diffserve_generation_requests_total` outcome of a request that raised `exc`."""
    status = as_api_error(exc).status
    return {429: "queue_full", 503: "unavailable"}.get(status, "invalid" if status < 500 else "failed")


def images_response(
    job: GenerateJob, result: JobFinished, base_url: str, api_key: str | None
) -> dict[str, Any]:
    """OpenAI's ImagesResponse, plus the seed used (a diffserve extension)."""
    if job.response_format == "url":
        data = []
        for image in result.images:
            url = f"{base_url.rstrip('/')}/v1/images/{image.image_id}/content"
            if api_key:
                url += f"?token={content_token(api_key, image.image_id)}"
            data.append({"url": url})
    else:
        data = [{"b64_json": base64.b64encode(image.data).decode("ascii")} for image in result.images]
    p = result.params
    return {
        "created": int(time.time()),
        "data": data,
        "output_format": p.output_format,
        "size": f"{p.width}x{p.height}",
        "quality": p.quality,
        "seed": p.seed,
        "usage": ZERO_USAGE,  # as the streamed completed events: no image tokens to bill
        # diffserve extension: with an approximate quality, fewer steps ran the DiT in full.
        "num_inference_steps": p.num_inference_steps,
        "steps_computed_in_full": result.steps_computed_in_full,
    }


#: Engine info that differs between replicas: with several, shown per replica, not in `engine`.
_PER_REPLICA_INFO = ("load_seconds", "warmup_seconds", "device_name")


def replica_info(client: EngineClient) -> dict[str, Any]:
    """One replica in /server_info: its state, process, restarts and load, and where it runs."""
    info = client.engine_info
    return {
        "replica": client.replica,
        "state": client.state.value,
        "detail": client.state_detail,
        "pid": client.engine_pid,
        "restarts": client.restarts,
        "waiting": client.num_waiting,
        "running": client.num_running,
        "completed": client.completed,
        "device_indices": None if client.device_indices is None else list(client.device_indices),
        **{k: info.get(k) for k in ("platform", *_PER_REPLICA_INFO)},
    }


def _versions() -> dict[str, str]:
    out = {"diffserve": diffserve.__version__, "python": platform.python_version()}
    for name in ("fastapi", "uvicorn", "pyzmq", "pydantic", "prometheus-client"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def create_app(args: ServerArgs, on_fatal: Callable[[int, str], None] | None = None) -> FastAPI:
    """The app; its lifespan starts and stops the engine process. `on_fatal(exit_code, message)` is
    called when the engine cannot start (the CLI then stops the server with that exit code)."""
    metrics = ServerMetrics()
    on_fatal = on_fatal or (lambda code, message: logger.error("Engine failed: %s", message))
    # One engine process as always, or --dp-size replicas behind this front end (replicas.py).
    engine: Engines = (
        EngineClient(args, metrics, on_fatal) if args.dp_size == 1 else ReplicaSet(args, metrics, on_fatal)
    )
    metrics.queue_depth.set_function(lambda: engine.num_waiting)
    metrics.running.set_function(lambda: engine.num_running)
    metrics.engine_ready.set_function(lambda: float(engine.ready))
    metrics.track_replicas(engine.replicas)
    video_jobs = VideoJobManager(args.output_dir, args.job_ttl, engine, metrics)
    # Only a video model gets a job store, opened before its engine takes requests (restarts included).
    engine.add_ready_hook(video_jobs.on_engine_ready)
    probe = HealthProbe(engine, HEALTH_GENERATE_TIMEOUT_S, HEALTH_GENERATE_REUSE_S)
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        remove_partial_images(args.output_dir)
        expire_images(args.output_dir, args.job_ttl)
        image_sweeper = asyncio.create_task(sweep_images(args.output_dir, args.job_ttl))
        try:
            await engine.start()
            yield
            await engine.wait_drained()  # video jobs have no connection the HTTP server would wait for
            await engine.stop()
        finally:
            image_sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await image_sweeper
        await video_jobs.close()

    app = FastAPI(
        title="diffserve", version=diffserve.__version__, lifespan=lifespan, description=DESCRIPTION
    )
    app.state.engine = engine  # for the runner's shutdown signal
    install_error_handlers(app)
    # Added innermost first: the request-context layer wraps everything, so every answer is logged.
    flags = "--max-image-bytes and --max-body-bytes"
    image_routes = {"/v1/images/edits": args.max_edit_body_bytes, "/v1/videos": args.max_video_body_bytes}
    path_limits = {path: (limit, flags) for path, limit in image_routes.items()}
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_body_bytes, path_limits=path_limits)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)

    def check_model(name: str | None) -> None:
        if name is not None and name not in args.model_aliases:
            message = f"model {name!r} is not served here; this server serves {args.model_id!r}"
            raise ApiError(404, message, param="model", code="model_not_found")

    def model_card() -> ModelCard:
        return ModelCard(id=args.model_id, created=started_at)

    def make_job(request: Request, body: ImageGenerationRequest, params: SamplingParams) -> GenerateJob:
        partial = (body.partial_images or 0) if body.stream else 0
        rid, fmt, priority = request.state.request_id, body.response_format or "b64_json", body.priority or 0
        return GenerateJob(
            rid, params, fmt, body.output_compression, partial_images=partial, priority=priority
        )

    async def start_stream(request: Request, job: GenerateJob, kind: StreamKind, arrived: float) -> Response:
        """Queue a streamed job and answer its event stream once the engine has accepted it: until then
        every error is a plain JSON error (raised here), after it an `error` event (streaming.py)."""
        messages: asyncio.Queue = asyncio.Queue()
        accepted, outcome = await run_unless_disconnected(request, engine.submit(job, messages.put_nowait))
        p = accepted.params
        header = StreamHeader(kind, f"{p.width}x{p.height}", p.output_format, quality=p.quality)

        def finished(result: JobFinished) -> None:
            metrics.observe_finished(result, time.monotonic() - arrived)

        def failed(exc: BaseException) -> None:
            metrics.count(outcome_of(exc) if isinstance(exc, Exception) else "failed")

        def abandoned() -> None:  # the client left (or an event could not be made): stop the job
            if engine.cancel(job.request_id):
                logger.info("Request %s: its stream ended early; cancelling it", job.request_id)
            metrics.count("cancelled")

        events = image_events(header, messages, outcome, finished, failed)
        return EventStreamResponse(events, on_abandon=abandoned)

    async def serve_images(
        request: Request,
        build_job: Callable[[], Awaitable[tuple[GenerateJob, ImageGenerationRequest]]],
        kind: StreamKind,
    ) -> Response:
        """Build the job (parsing errors count as invalid requests), run it unless the client goes away,
        and answer OpenAI's ImagesResponse, or its event stream when the body asks for `stream`."""
        arrived = time.monotonic()
        try:
            job, body = await build_job()
            if body.stream:
                return await start_stream(request, job, kind, arrived)
            result = await run_unless_disconnected(request, engine.generate(job))
        except ClientDisconnected:
            metrics.count("cancelled")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            metrics.count(outcome_of(exc))
            raise
        metrics.observe_finished(result, time.monotonic() - arrived)
        return JSONResponse(
            images_response(job, result, args.public_url or str(request.base_url), args.api_key)
        )

    @app.post("/v1/images/generations", response_model=ImagesResponse, responses=_IMAGE_RESPONSES)
    async def create_images(body: ImageGenerationRequest, request: Request) -> Response:
        async def build_job() -> tuple[GenerateJob, ImageGenerationRequest]:
            check_route(engine, video=False)
            check_model(body.model)
            return make_job(request, body, body.to_sampling_params()), body

        return await serve_images(request, build_job, "image_generation")

    @app.post(
        "/v1/images/edits",
        response_model=ImagesResponse,
        responses={**_IMAGE_RESPONSES, **documented(415)},
        openapi_extra=EDIT_REQUEST_BODY,
    )
    async def edit_images(request: Request) -> Response:
        """OpenAI's image edits: the input image(s) and the prompt, as multipart/form-data (as the `openai`
        SDK sends them) or JSON; the other fields are those of /v1/images/generations, plus `strength`
        (image-to-image, 0..1) and an optional `mask` (inpainting: transparent pixels, or without alpha
        white ones, mark the area to edit). Without `size` the model's family derives the size from the
        input image, as Diffusers does."""

        async def build_job() -> tuple[GenerateJob, ImageGenerationRequest]:
            check_route(engine, video=False)
            model = EditModel.served(engine, args)
            inputs = await read_edit_request(request, args.max_edit_body_bytes, model)
            check_model(inputs.body.model)
            params = inputs.body.to_sampling_params()
            images = await inputs.decode(args.allow_url_images, args.image_limits)
            params.input_images, params.mask_image = images
            return make_job(request, inputs.body, params), inputs.body

        return await serve_images(request, build_job, "image_edit")

    @app.get(
        "/v1/images/{image_id}/content", response_class=Response, responses={200: _IMAGE_FILE, **_ERRORS}
    )
    async def image_content(image_id: str) -> ContentFileResponse:
        path = find_image(args.output_dir, image_id, ttl=args.job_ttl)
        if path is None:
            message = f"no image with id {image_id!r} on this server (unknown, or expired after --job-ttl)"
            raise ApiError(404, message, param="image_id", code="image_not_found")
        return ContentFileResponse(path, media_type=CONTENT_TYPES[path.suffix.lstrip(".")])

    app.include_router(video_router(args, engine, video_jobs, metrics, check_model, outcome_of))
    app.include_router(lora_router(engine))
    if args.webui:  # the playground at / (webui_routes.py)
        from diffserve.server.webui_routes import webui_router

        app.include_router(webui_router())

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id)
        return model_card()

    @app.head("/health", responses=_ERRORS)  # load balancers that probe with HEAD
    @app.get("/health", responses=_ERRORS)
    async def health() -> Response:
        if not engine.ready:
            err = engine.unavailable_error()
            return error_response(503, str(err), None, err.code)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate", responses=_ERRORS)
    async def health_generate(request: Request) -> Response:
        """A real 1-step generation at a small size through the queue, rate-limited by HealthProbe
        (a reused result says `"cached": true`)."""
        try:
            result, reused = await probe.result(request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = {**result.body, "cached": reused} if result.status == 200 else result.body
        return JSONResponse(body, status_code=result.status)

    @app.get("/server_info", responses=_ERRORS)
    async def server_info() -> dict[str, Any]:
        replicas = [replica_info(client) for client in engine.replicas]
        hidden = {"versions", "replica", "loras", *(_PER_REPLICA_INFO if len(replicas) > 1 else ())}
        loras = await live_lora_state(engine)
        return {
            "model": args.model_id,
            "server_args": args.to_dict(),
            "engine": {  # one replica: its engine; several: the state clients see, the sums, the model
                "state": engine.state.value,
                "detail": engine.state_detail,
                "pid": replicas[0]["pid"] if len(replicas) == 1 else None,
                "restarts": sum(replica["restarts"] for replica in replicas),
                "waiting": engine.num_waiting,
                "running": engine.num_running,
                **{k: v for k, v in engine.engine_info.items() if k not in hidden},
                # Adapters (name, rank, bytes, in_use, ...), merged ones, resident bytes, --max-lora-memory.
                "loras": loras,
            },
            "replicas": replicas,
            "versions": {**_versions(), **engine.engine_info.get("versions", {})},
            "front_end_pid": os.getpid(),
            "python_executable": sys.executable,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
