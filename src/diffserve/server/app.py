"""The HTTP front end: FastAPI routes over the engine client. Nothing here waits on model work.

A request's path: `POST /v1/images/generations` -> `ImageGenerationRequest` (schemas.py) ->
`SamplingParams` -> `EngineClient.generate` (engine_client.py) -> ZeroMQ -> the engine process
(engine_process.py: validate, queue, `DiffGenerator.generate_from_params`, encode) -> back here as
`JobFinished` -> OpenAI's `ImagesResponse`. `POST /v1/images/edits` is the same path once its body
(multipart or JSON, image_edits.py) is parsed and its input images are decoded into the params. With
`"stream": true` both answer OpenAI's server-sent events instead, previews first (streaming.py).
`/v1/videos` (video_routes.py, jobs in video_jobs.py) answers with a job at once and runs it in the
background; the image routes refuse video models and the video routes image models, naming the route
to use.
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
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

import diffserve
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.outputs import CONTENT_TYPES
from diffserve.server.args import MAX_INPUT_IMAGES, ServerArgs
from diffserve.server.engine_client import (
    EngineClient,
    EngineUnavailableError,
    JobFailedError,
    JobRejectedError,
    QueueFullError,
)
from diffserve.server.errors import ApiError, error_response, install_error_handlers
from diffserve.server.image_edits import read_edit_request
from diffserve.server.image_files import find_image
from diffserve.server.metrics import ServerMetrics
from diffserve.server.middleware import (
    CLIENT_CLOSED_REQUEST,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestContextMiddleware,
    content_token,
)
from diffserve.server.protocol import GenerateJob, JobFinished
from diffserve.server.schemas import (
    EDIT_ACCEPTED_FIELDS,
    ApiParamError,
    ErrorResponse,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
)
from diffserve.server.streaming import EventStreamResponse, ImageEventStream, StreamHeader, StreamKind
from diffserve.server.video_jobs import VideoJobManager
from diffserve.server.video_routes import check_image_model, video_router

logger = logging.getLogger("diffserve.server")

HEALTH_GENERATE_TIMEOUT_S = 120.0
T = TypeVar("T")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}
#: The image routes answer JSON, or server-sent events with `"stream": true` (documented in /docs).
_IMAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    200: {
        "description": 'ImagesResponse; with "stream": true, server-sent events '
        "(image_generation.partial_image and image_generation.completed, image_edit.* on /v1/images/edits)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}


def _inline_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$defs` references inlined (openapi_extra has no components)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        return node

    return walk(schema)


#: /v1/images/edits reads its body itself (multipart or JSON); this documents both forms in /docs.
_EDIT_REQUEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["image", "prompt"],
                    "properties": {
                        "image": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "description": f"1-{MAX_INPUT_IMAGES} image files, as 'image' or 'image[]' parts",
                        },
                        "mask": {"type": "string", "format": "binary"},
                        **{
                            name: {"type": "string"}
                            for name in EDIT_ACCEPTED_FIELDS
                            if name not in ("image", "images", "mask")
                        },
                    },
                }
            },
            "application/json": {"schema": _inline_schema(ImageEditRequest.model_json_schema())},
        },
    }
}


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) when the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
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


def outcome_of(exc: Exception) -> str:
    """The `diffserve_generation_requests_total` outcome of a request that raised `exc`."""
    if isinstance(exc, (ApiError, ApiParamError, InvalidRequestError, JobRejectedError)):
        return "invalid"
    if isinstance(exc, JobFailedError):
        return "invalid" if exc.user_error else "failed"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, EngineUnavailableError):
        return "unavailable"
    return "failed"


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
        # diffserve extension: with an approximate quality, fewer steps ran the DiT in full.
        "num_inference_steps": p.num_inference_steps,
        "steps_computed_in_full": result.steps_computed_in_full,
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

    def default_on_fatal(code: int, message: str) -> None:
        logger.error("Engine failed: %s", message)

    engine = EngineClient(args, metrics, on_fatal or default_on_fatal)
    metrics.track_engine(lambda: engine.num_waiting, lambda: engine.num_running, lambda: float(engine.ready))
    video_jobs = VideoJobManager(args.output_dir, args.job_ttl, engine, metrics)
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        video_jobs.open()  # before the engine: jobs a previous server left unfinished are failed first
        await engine.start()
        yield
        await engine.stop()
        await video_jobs.close()

    app = FastAPI(
        title="diffserve",
        version=diffserve.__version__,
        lifespan=lifespan,
        description="OpenAI-compatible image and video generation with diffserve",
    )
    app.state.args = args
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.video_jobs = video_jobs
    install_error_handlers(app)
    # Added innermost first: the request-context layer wraps everything, so every answer is logged.
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=args.max_body_bytes,
        path_limits={
            "/v1/images/edits": (args.max_edit_body_bytes, "--max-image-bytes and --max-body-bytes"),
            "/v1/videos": (args.max_video_body_bytes, "--max-image-bytes and --max-body-bytes"),
        },
    )
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)

    def check_model(name: str | None) -> None:
        if name is not None and name not in args.model_aliases:
            raise ApiError(
                404,
                f"model {name!r} is not served here; this server serves {args.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def model_card() -> ModelCard:
        return ModelCard(id=args.model_id, created=started_at)

    def make_job(request: Request, body: ImageGenerationRequest, params: SamplingParams) -> GenerateJob:
        partial_images = (body.partial_images or 0) if body.stream else 0
        return GenerateJob(
            request.state.request_id,
            params,
            body.response_format or "b64_json",
            body.output_compression,
            partial_images=partial_images,
            priority=body.priority or 0,
        )

    async def start_stream(request: Request, job: GenerateJob, kind: StreamKind, arrived: float) -> Response:
        """Queue a streamed job and answer its event stream once the engine has accepted it: until then
        every error is a plain JSON error (raised here), after it an `error` event (streaming.py)."""
        messages: asyncio.Queue = asyncio.Queue()
        accepted, outcome = await run_unless_disconnected(request, engine.submit(job, messages.put_nowait))
        p = accepted.params
        header = StreamHeader(
            kind, size=f"{p.width}x{p.height}", output_format=p.output_format, quality=p.quality
        )

        def finished(result: JobFinished) -> None:
            metrics.generation_requests.labels("success").inc()
            metrics.observe_finished(result, time.monotonic() - arrived)

        def failed(exc: BaseException) -> None:
            outcome = outcome_of(exc) if isinstance(exc, Exception) else "failed"
            metrics.generation_requests.labels(outcome).inc()

        def abandoned() -> None:  # the client left (or an event could not be made): stop the job
            if engine.cancel(job.request_id):
                logger.info("Request %s: its stream ended early; cancelling it", job.request_id)
            metrics.generation_requests.labels("cancelled").inc()

        stream = ImageEventStream(header, messages, outcome, finished, failed)
        return EventStreamResponse(stream.events(), on_abandon=abandoned)

    async def serve_images(
        request: Request,
        build_job: Callable[[], Awaitable[tuple[GenerateJob, ImageGenerationRequest]]],
        kind: StreamKind,
    ) -> Response:
        """The common part of the image routes: build the job (parsing errors count as invalid
        requests), run it unless the client goes away, answer OpenAI's ImagesResponse, or its event
        stream when the body asks for `stream`."""
        arrived = time.monotonic()
        try:
            job, body = await build_job()
            if body.stream:
                return await start_stream(request, job, kind, arrived)
            result = await run_unless_disconnected(request, engine.generate(job))
        except ClientDisconnected:
            metrics.generation_requests.labels("cancelled").inc()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            metrics.generation_requests.labels(outcome_of(exc)).inc()
            raise
        metrics.generation_requests.labels("success").inc()
        metrics.observe_finished(result, time.monotonic() - arrived)
        return JSONResponse(images_response(job, result, str(request.base_url), args.api_key))

    @app.post("/v1/images/generations", response_model=ImagesResponse, responses=_IMAGE_RESPONSES)
    async def create_images(body: ImageGenerationRequest, request: Request) -> Response:
        async def build_job() -> tuple[GenerateJob, ImageGenerationRequest]:
            check_image_model(engine)
            check_model(body.model)
            return make_job(request, body, body.to_sampling_params()), body

        return await serve_images(request, build_job, "image_generation")

    @app.post(
        "/v1/images/edits",
        response_model=ImagesResponse,
        responses={**_IMAGE_RESPONSES, 415: _ERRORS[400]},
        openapi_extra=_EDIT_REQUEST_BODY,
    )
    async def edit_images(request: Request) -> Response:
        """OpenAI's image edits: the input image(s) and the prompt, as multipart/form-data (what the
        `openai` SDK sends: files `image` or `image[]`, optional `mask`, every other field as text, the
        `extra_body` extensions included) or as JSON (`image`: data URL string or list, or
        `images: [{"image_url": ...}]`). The other fields are those of /v1/images/generations.

        Without `size` the output size is left to the model's family, which derives it from the input
        image as Diffusers does (edit models keep the input's aspect ratio). Whether the model takes
        input images at all, how many, and a mask, is the engine's call (400 naming `image` or `mask`).
        """

        async def build_job() -> tuple[GenerateJob, ImageGenerationRequest]:
            check_image_model(engine)
            inputs = await read_edit_request(request, max_text_part_bytes=args.max_edit_body_bytes)
            check_model(inputs.body.model)
            params = inputs.body.to_sampling_params()
            params.input_images, params.mask_image = await asyncio.to_thread(
                inputs.load, args.allow_url_images, args.image_limits
            )
            return make_job(request, inputs.body, params), inputs.body

        return await serve_images(request, build_job, "image_edit")

    @app.get("/v1/images/{image_id}/content", responses=_ERRORS)
    async def image_content(image_id: str) -> FileResponse:
        path = find_image(args.output_dir, image_id)
        if path is None:
            raise ApiError(
                404, f"no image with id {image_id!r} on this server", param="image_id", code="image_not_found"
            )
        return FileResponse(path, media_type=CONTENT_TYPES[path.suffix.lstrip(".")])

    app.include_router(video_router(args, engine, video_jobs, metrics, check_model, outcome_of))

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id)
        return model_card()

    @app.get("/health", responses=_ERRORS)
    async def health() -> Response:
        if not engine.ready:
            err = engine.unavailable_error()
            return error_response(503, str(err), None, err.code)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate", responses=_ERRORS)
    async def health_generate(request: Request) -> Response:
        size = engine.probe_size
        params = SamplingParams(prompt="health check", height=size, width=size, num_inference_steps=1)
        job = GenerateJob(request.state.request_id, params, internal=True)
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(engine.generate(job), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(
                503,
                f"the health-check generation did not finish in {HEALTH_GENERATE_TIMEOUT_S:g} s",
                None,
                "health_check_timeout",
            )
        except (JobFailedError, JobRejectedError) as exc:
            return error_response(
                503, f"the health-check generation failed: {exc}", None, "health_check_failed"
            )
        return JSONResponse(
            {
                "status": "ok",
                "seconds": round(time.monotonic() - start, 4),
                "engine_seconds": round(result.engine_seconds, 4),
                "size": f"{size}x{size}",
                "num_inference_steps": 1,
            }
        )

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "model": args.model_id,
            "server_args": args.to_dict(),
            "engine": {
                "state": engine.state.value,
                "detail": engine.state_detail,
                "pid": engine.engine_pid,
                "restarts": engine.restarts,
                "waiting": engine.num_waiting,
                "running": engine.num_running,
                **{k: v for k, v in engine.engine_info.items() if k != "versions"},
            },
            "versions": {**_versions(), **engine.engine_info.get("versions", {})},
            "front_end_pid": os.getpid(),
            "python_executable": sys.executable,
        }

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
