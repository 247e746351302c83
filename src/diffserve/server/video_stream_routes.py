"""Chunk streaming of `/v1/videos` jobs created with `"stream": true` (video_stream.py).

GET /v1/videos/{id}/stream   Server-Sent Events: `video.init` (the fragmented MP4's init segment and its
                             MediaSource type), one `video.chunk` per chunk (its index, frames, time
                             range and media segment, base64), then `video.done` (the job object, its
                             final status). A subscriber that comes late gets every chunk so far first.
WS  /v1/realtime/videos      send the body of POST /v1/videos (JSON text; `stream` is implied); receive
                             `video.created` (the job), then per segment a JSON header (`video.init` /
                             `video.chunk`, as the events above without `data`) followed by the segment
                             as one binary message, then `video.done` (the job). A bad request gets an
                             `error` message (OpenAI's error object, its `param` naming the field) and
                             the socket is closed.

The job's MP4 (`GET /v1/videos/{id}/content`) is byte for byte the init segment followed by every
chunk's segment. A client that leaves (either route) stops nothing: the job runs on and stays readable.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from starlette.websockets import WebSocketState

from diffserve.server.access import OPEN, PRINCIPAL_STATE, Caller, Principal
from diffserve.server.app_state import AppState, ServerState, app_state_of
from diffserve.server.errors import ApiError, as_api_error, documented, error_body
from diffserve.server.request_body import validate
from diffserve.server.schemas import VIDEO_ACCEPTED_FIELDS, ImageReference, VideoCreateRequest
from diffserve.server.streaming import EventStreamResponse, sse_event
from diffserve.server.video_jobs import VideoJob
from diffserve.server.video_routes import check_store, found, submit_video
from diffserve.server.video_stream import b64, subscribe

logger = logging.getLogger("diffserve.server")

router = APIRouter()

_STREAM_RESPONSES = {
    200: {"description": "server-sent events: video.init, video.chunk..., video.done",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **documented(400, 401, 404, 409, 503),
}  # fmt: skip


def _not_streamed(job: VideoJob) -> ApiError:
    message = (
        f'video {job.id} was created without "stream": true, so its chunks are not published; create the '
        f"job with stream=true, or download GET /v1/videos/{job.id}/content once it is completed"
    )
    return ApiError(409, message, param="video_id", code="video_not_streamed")


async def _events(state: AppState, job: VideoJob) -> AsyncIterator[tuple[dict[str, Any], bytes | None]]:
    """The job's stream as (JSON header, segment bytes or None): init, chunks, then the job object."""
    jobs = state.video_jobs
    stream = await jobs.chunks(job)
    if stream is not None:
        async for kind, meta, data in subscribe(stream):
            if kind == "init":
                yield {"type": "video.init", "mime_type": meta, "size_bytes": len(data or b"")}, data
            elif kind == "chunk":
                yield {"type": "video.chunk", **meta.meta()}, meta.data
            else:
                yield {"type": "keepalive"}, None
    final = jobs.get(job.id) or job  # its final status (deleted meanwhile: as last seen)
    # `finished_at`: the unix time the job finished, to the microsecond (the job object's is whole seconds).
    yield {"type": "video.done", "finished_at": final.completed_at, "video": final.to_api(jobs.ttl)}, None


async def _sse(state: AppState, job: VideoJob) -> AsyncIterator[bytes]:
    async for header, data in _events(state, job):
        if header["type"] == "keepalive":
            yield b": keep-alive\n\n"
            continue
        payload = {**header, "data": b64(data)} if data is not None else header
        yield sse_event(header["type"], payload)


@router.get("/v1/videos/{video_id}/stream", response_class=Response, responses=_STREAM_RESPONSES)
async def stream_video(video_id: str, state: ServerState, caller: Caller) -> EventStreamResponse:
    """The chunks of a job created with `"stream": true`, as server-sent events (see the module)."""
    job = found(state, video_id, caller)
    if not job.stream:
        raise _not_streamed(job)
    return EventStreamResponse(_sse(state, job), on_abandon=lambda: None)  # the job runs on


def _principal(websocket: WebSocket) -> Principal:
    principal = websocket.scope.get("state", {}).get(PRINCIPAL_STATE)
    return principal if isinstance(principal, Principal) else OPEN


async def _send_error(websocket: WebSocket, exc: BaseException) -> None:
    error = as_api_error(exc)
    body = error_body(error.status, error.message, error.param, error.code)
    with contextlib.suppress(Exception):
        await websocket.send_json({"type": "error", "status": error.status, **body})
        await websocket.close(code=1008 if error.status < 500 else 1011)


async def _read_request(websocket: WebSocket, max_bytes: int) -> tuple[VideoCreateRequest, str | None]:
    """The first message: POST /v1/videos' JSON body, within its limit (`--max-video-body-bytes`)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        raise ApiError(400, "send the request as one JSON text message, not binary", code="invalid_request")
    if len(text.encode()) > max_bytes:
        size = len(text.encode())
        raise ApiError(
            413,
            f"request of {size} bytes exceeds the server's limit of {max_bytes} bytes",
            code="request_too_large",
        )
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the first message is not valid JSON ({exc})", code="invalid_request") from None
    body = validate(VideoCreateRequest, data, VIDEO_ACCEPTED_FIELDS)
    reference = body.input_reference
    if isinstance(reference, ImageReference):
        reference = reference.source("input_reference")
    return body, reference


@router.websocket("/v1/realtime/videos")
async def realtime_videos(websocket: WebSocket) -> None:
    """Create a streamed video job and receive its chunks on one socket (see the module)."""
    state = app_state_of(websocket.app)
    await websocket.accept()
    try:
        try:
            body, reference = await _read_request(websocket, state.args.max_video_body_bytes)
            check_store(state)  # an image model: 400 naming its route; not ready: 503
        except WebSocketDisconnect:
            raise
        except Exception as exc:
            state.count_failure(exc)  # as POST /v1/videos counts a body it refuses
            raise
        body.stream = True
        job = await submit_video(state, _principal(websocket), body, reference)
    except WebSocketDisconnect:
        return
    except Exception as exc:
        if not isinstance(exc, (ApiError, ValueError)):
            logger.warning("/v1/realtime/videos: %s: %s", type(exc).__name__, exc)
        await _send_error(websocket, exc)
        return
    try:
        await websocket.send_json({"type": "video.created", "video": job.to_api(state.video_jobs.ttl)})
        async for header, data in _events(state, job):
            if header["type"] == "keepalive":
                continue
            await websocket.send_json(header)
            if data is not None:
                await websocket.send_bytes(data)
        await websocket.close()
    except (WebSocketDisconnect, RuntimeError, OSError):
        return  # the client left: the job runs on
    finally:
        if websocket.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await websocket.close()
