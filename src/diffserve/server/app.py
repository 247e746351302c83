"""The HTTP front end: FastAPI routes over the engine client; nothing here waits on model work.

`create_app` builds the server's parts once (`AppState`, app_state.py: the engine client, or the
--dp-size replicas of replicas.py, the metrics, the video jobs and the health probe), adds the
middleware and includes one router per route group, each in its own module and reaching the server only
through that state:

- image_routes.py: `/v1/images/generations` and `/v1/images/edits` (the edits body is read by
  image_edits.py) answer OpenAI's ImagesResponse, or its server-sent events with `"stream": true`
  (streaming.py); `/v1/images/{image_id}/content` serves url answers' files;
- video_routes.py: `/v1/videos` answers with a job at once and runs it in the background (video_jobs.py);
  video_stream_routes.py publishes the chunks of `"stream": true` jobs (SSE, `/v1/realtime/videos`);
- lora_routes.py: `/v1/loras` loads, lists and unloads the LoRA adapters requests name in `loras`;
- webui_routes.py: the playground at `/` (unless --no-webui);
- status_routes.py: `/v1/models`, `/health`, `/health_generate` and `/server_info`;
- metrics_routes.py: `/metrics`.

Each generation route refuses models of the other kind, naming the route to use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

import diffserve
from diffserve.server import (
    image_routes,
    lora_routes,
    metrics_routes,
    status_routes,
    video_routes,
    video_stream_routes,
    webui_routes,
)
from diffserve.server.access import PathRedactionMiddleware, PathRedactor, server_path_roots
from diffserve.server.app_state import AppState, app_state_of, set_app_state
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient
from diffserve.server.errors import install_error_handlers
from diffserve.server.health_probe import HealthProbe
from diffserve.server.image_files import expire_images, remove_partial_images, sweep_images
from diffserve.server.metrics import ServerMetrics
from diffserve.server.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestContextMiddleware
from diffserve.server.replicas import Engines, ReplicaSet
from diffserve.server.video_jobs import VideoJobManager

logger = logging.getLogger("diffserve.server")

HEALTH_GENERATE_TIMEOUT_S = 120.0
HEALTH_GENERATE_REUSE_S = 5.0  # /health_generate reuses the last probe's result this long
DESCRIPTION = "OpenAI-compatible image and video generation with diffserve"


def create_app(
    args: ServerArgs,
    on_fatal: Callable[[int, str], None] | None = None,
    engines: Callable[[ServerMetrics], Engines] | None = None,
) -> FastAPI:
    """The app; its lifespan starts and stops the engine process. `on_fatal(exit_code, message)` is
    called when the engine cannot start (the CLI then stops the server with that exit code). `engines`
    makes the engine side from the server's metrics instead (Ray Serve's replicas: deploy/engines.py)."""
    state = build_state(args, on_fatal or log_engine_failure, engines)
    app = FastAPI(
        title="diffserve", version=diffserve.__version__, lifespan=lifespan, description=DESCRIPTION
    )
    set_app_state(app, state)
    install_error_handlers(app)
    add_middleware(app, args, state.metrics)
    app.include_router(image_routes.router)
    app.include_router(video_routes.router)
    app.include_router(video_stream_routes.router)
    app.include_router(lora_routes.router)
    if args.webui:
        app.include_router(webui_routes.router)
    app.include_router(status_routes.router)
    app.include_router(metrics_routes.router)
    return app


def log_engine_failure(exit_code: int, message: str) -> None:
    """`create_app`'s `on_fatal` when the caller gives none: log it, and keep serving 503s."""
    logger.error("Engine failed: %s", message)


def build_state(
    args: ServerArgs,
    on_fatal: Callable[[int, str], None],
    engines: Callable[[ServerMetrics], Engines] | None = None,
) -> AppState:
    """The server's parts, wired together: the engine side reports its load to the metrics, and a video
    model's job store is opened before its engine takes requests (restarts included)."""
    metrics = ServerMetrics()
    # One engine process as always, or --dp-size replicas behind this front end (replicas.py), or what
    # `engines` makes.
    engine: Engines
    if engines is not None:
        engine = engines(metrics)
    elif args.dp_size == 1:
        engine = EngineClient(args, metrics, on_fatal)
    else:
        engine = ReplicaSet(args, metrics, on_fatal)
    metrics.queue_depth.set_function(lambda: engine.num_waiting)
    metrics.running.set_function(lambda: engine.num_running)
    metrics.engine_ready.set_function(lambda: float(engine.ready))
    metrics.track_replicas(engine.replicas)
    video_jobs = VideoJobManager(args.output_dir, args.job_ttl, engine, metrics)
    engine.add_ready_hook(video_jobs.on_engine_ready)  # only a video model gets a job store
    probe = HealthProbe(engine, HEALTH_GENERATE_TIMEOUT_S, HEALTH_GENERATE_REUSE_S)
    return AppState(args, engine, metrics, video_jobs, probe, started_at=int(time.time()))


def add_middleware(app: FastAPI, args: ServerArgs, metrics: ServerMetrics) -> None:
    """Body size limits, the hiding of server paths from callers who are not admins (with an admin key),
    the API keys (when the server has any; they decide the caller) and the request context, added
    innermost first: the request-context layer wraps everything, so every answer is logged."""
    flags = "--max-image-bytes and --max-body-bytes"
    upload_routes = {"/v1/images/edits": args.max_edit_body_bytes, "/v1/videos": args.max_video_body_bytes}
    path_limits = {path: (limit, flags) for path, limit in upload_routes.items()}
    app.add_middleware(
        BodySizeLimitMiddleware, max_bytes=args.max_body_bytes, path_limits=path_limits,
        idle_timeout=args.body_timeout,
    )  # fmt: skip
    if args.admin_api_key:
        engine = args.engine_args
        files = [*(spec.path for spec in engine.loras), *filter(None, [engine.transformer_weights])]
        roots = server_path_roots(engine.model_path, engine.output_path, engine.lora_dir, files)
        app.add_middleware(PathRedactionMiddleware, redactor=PathRedactor(roots))
    if args.api_key or args.admin_api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, admin_api_key=args.admin_api_key)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Clean up the image files left by the last run, sweep expired ones while serving, and start the
    engine; at shutdown wait for running jobs, then stop the engine and close the video job store."""
    state = app_state_of(app)
    args, engine = state.args, state.engine
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
    await state.video_jobs.close()
