"""The image routes: `/v1/images/generations`, `/v1/images/edits` and `/v1/images/{image_id}/content`.

Both generation routes turn a request (schemas.py; the edits body is read by image_edits.py) into a job
for the engine and answer OpenAI's ImagesResponse, or its server-sent events with `"stream": true`
(streaming.py); they share `serve_images`, so both count, cancel and stream alike. The content route
serves the files of `"response_format": "url"` answers.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from diffserve.configs.sampling_params import ControlNetChoice, SamplingParams
from diffserve.outputs import CONTENT_TYPES
from diffserve.server.app_state import AppState, ServerState, outcome_of
from diffserve.server.controlnet_schema import decode_controlnets
from diffserve.server.disconnects import ClientDisconnected, run_unless_disconnected
from diffserve.server.errors import ApiError, documented
from diffserve.server.image_edits import EDIT_REQUEST_BODY, EditModel, read_edit_request
from diffserve.server.image_files import find_image
from diffserve.server.middleware import CLIENT_CLOSED_REQUEST, content_token
from diffserve.server.protocol import GenerateJob, JobFinished
from diffserve.server.schemas import ImageGenerationRequest, ImagesResponse
from diffserve.server.streaming import (
    ZERO_USAGE,
    ContentFileResponse,
    EventStreamResponse,
    StreamHeader,
    StreamKind,
    image_events,
)
from diffserve.server.video_routes import check_route

logger = logging.getLogger("diffserve.server")

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

#: Builds a route's job from its request; its errors are answered as the request's.
JobBuilder = Callable[[], Awaitable[tuple[GenerateJob, ImageGenerationRequest]]]

router = APIRouter()


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
        # diffserve extension: the cache method (or tier) that ran, its settings, steps and blocks reused.
        "cache": result.cache,
    }


def make_job(request: Request, body: ImageGenerationRequest, params: SamplingParams) -> GenerateJob:
    """The engine job of an image request: its id, output options, previews (streamed only) and priority."""
    partial = (body.partial_images or 0) if body.stream else 0
    rid, fmt, priority = request.state.request_id, body.response_format or "b64_json", body.priority or 0
    return GenerateJob(rid, params, fmt, body.output_compression, partial_images=partial, priority=priority)


async def start_stream(
    state: AppState, request: Request, job: GenerateJob, kind: StreamKind, arrived: float
) -> Response:
    """Queue a streamed job and answer its event stream once the engine has accepted it: until then
    every error is a plain JSON error (raised here), after it an `error` event (streaming.py)."""
    engine, metrics = state.engine, state.metrics
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
    state: AppState, request: Request, build_job: JobBuilder, kind: StreamKind
) -> Response:
    """Build the job (parsing errors count as invalid requests), run it unless the client goes away,
    and answer OpenAI's ImagesResponse, or its event stream when the body asks for `stream`."""
    arrived = time.monotonic()
    try:
        job, body = await build_job()
        if body.stream:
            return await start_stream(state, request, job, kind, arrived)
        result = await run_unless_disconnected(request, state.engine.generate(job))
    except ClientDisconnected:
        state.metrics.count("cancelled")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except Exception as exc:
        state.count_failure(exc)
        raise
    state.metrics.observe_finished(result, time.monotonic() - arrived)
    args = state.args
    token_key = args.api_keys[0] if args.api_keys else None  # ApiKeyMiddleware checks tokens with it
    return JSONResponse(images_response(job, result, args.public_url or str(request.base_url), token_key))


async def _controlnets(body: ImageGenerationRequest, state: ServerState) -> list[ControlNetChoice]:
    """The request's `controlnets` with their control images and masks decoded (off the event loop when
    any)."""
    if not body.controlnets:
        return []
    args = state.args
    return await asyncio.to_thread(
        decode_controlnets, body.controlnets, args.allow_url_images, args.image_limits
    )


@router.post("/v1/images/generations", response_model=ImagesResponse, responses=_IMAGE_RESPONSES)
async def create_images(body: ImageGenerationRequest, request: Request, state: ServerState) -> Response:
    async def build_job() -> tuple[GenerateJob, ImageGenerationRequest]:
        check_route(state.engine, video=False)
        state.check_model(body.model)
        params = body.to_sampling_params()
        params.controlnets = await _controlnets(body, state)
        return make_job(request, body, params), body

    return await serve_images(state, request, build_job, "image_generation")


@router.post(
    "/v1/images/edits",
    response_model=ImagesResponse,
    responses={**_IMAGE_RESPONSES, **documented(415)},
    openapi_extra=EDIT_REQUEST_BODY,
)
async def edit_images(request: Request, state: ServerState) -> Response:
    """OpenAI's image edits: the input image(s) and the prompt, as multipart/form-data (as the `openai`
    SDK sends them) or JSON; the other fields are those of /v1/images/generations, plus `strength`
    (image-to-image, 0..1) and an optional `mask` (inpainting: transparent pixels, or without alpha
    white ones, mark the area to edit). Without `size` the model's family derives the size from the
    input image, as Diffusers does."""
    args = state.args

    async def build_job() -> tuple[GenerateJob, ImageGenerationRequest]:
        check_route(state.engine, video=False)
        model = EditModel.served(state.engine, args)
        inputs = await read_edit_request(request, args.max_edit_body_bytes, model)
        state.check_model(inputs.body.model)
        params = inputs.body.to_sampling_params()
        params.controlnets = await _controlnets(inputs.body, state)
        images = await inputs.decode(args.allow_url_images, args.image_limits)
        params.input_images, params.mask_image = images
        return make_job(request, inputs.body, params), inputs.body

    return await serve_images(state, request, build_job, "image_edit")


@router.get("/v1/images/{image_id}/content", response_class=Response, responses={200: _IMAGE_FILE, **_ERRORS})
async def image_content(image_id: str, state: ServerState) -> ContentFileResponse:
    path = find_image(state.args.output_dir, image_id, ttl=state.args.job_ttl)
    if path is None:
        message = f"no image with id {image_id!r} on this server (unknown, or expired after --job-ttl)"
        raise ApiError(404, message, param="image_id", code="image_not_found")
    return ContentFileResponse(path, media_type=CONTENT_TYPES[path.suffix.lstrip(".")])
