"""`/v1/videos`: OpenAI's video API (as SGLang and vLLM-Omni serve it) over `VideoJobManager`.

POST   /v1/videos                 create a job (JSON or multipart, as `client.videos.create` sends it);
                                  video-to-video models take the video to extend as `video`
GET    /v1/videos                 list jobs (`limit`, `after`, `order`), newest first
GET    /v1/videos/{id}            one job: status, progress, error
GET    /v1/videos/{id}/content    the MP4 (`variant=video`), with HTTP Range support
DELETE /v1/videos/{id}            cancel a job in flight, or delete a finished one

Jobs created with `"stream": true` also publish their chunks (video_stream_routes.py).

A job belongs to the key that created it (access.py): on a server with client keys another key's job is
a 404 on every route and absent from the list; the admin key sees every job.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from diffserve.image_inputs import ImageTooLargeError
from diffserve.server.access import Caller, Principal
from diffserve.server.app_state import AppState, ServerState
from diffserve.server.engine_client import JobRejectedError
from diffserve.server.errors import ApiError, documented
from diffserve.server.image_edits import inline_schema
from diffserve.server.model_info import suggested_pipelines
from diffserve.server.protocol import wrong_route
from diffserve.server.replicas import Engines
from diffserve.server.request_body import DECODE_POOL, RawImage, check_source, load_input_image, read_body
from diffserve.server.schemas import VIDEO_ACCEPTED_FIELDS, ApiParamError, ImageReference, VideoCreateRequest
from diffserve.server.streaming import ContentFileResponse
from diffserve.server.video_jobs import VIDEO_ID_PATTERN, VideoJob, video_file
from diffserve.video_inputs import VideoInputLimits, load_video, refuse_input_video

DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
_REFERENCE_PARTS = ("input_reference", "input_reference[image_url]", "input_reference[file_id]")
#: The multipart part of the video to extend (video-to-video models).
VIDEO_PART = "video"
#: Engine parameter names -> the request field a client of this route set.
_PARAM_NAMES = {"height": "size", "width": "size", "image": "input_reference"}

_ERRORS = documented(400, 401, 404, 409, 413, 415, 429, 503)


def _create_request_body() -> dict[str, Any]:
    """POST /v1/videos reads its body itself: its `openapi_extra`, both forms `client.videos.create` and
    JSON clients send, so /docs and schema fuzzers see the real fields."""
    binary = {"type": "string", "format": "binary", "description": "the first frame (image-to-video)"}
    video = {"type": "string", "format": "binary", "description": "the video to extend (video-to-video)"}
    text = {
        name: {"type": "string"} for name in VIDEO_ACCEPTED_FIELDS if name not in ("input_reference", "video")
    }
    properties = {"input_reference": binary, VIDEO_PART: video, **text}
    form = {"type": "object", "required": ["prompt"], "properties": properties}
    json_schema = inline_schema(VideoCreateRequest.model_json_schema())
    content = {"multipart/form-data": {"schema": form}, "application/json": {"schema": json_schema}}
    return {"requestBody": {"required": True, "content": content}}


_CONTENT_RESPONSES = {
    200: {"description": "the MP4", "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}},
    206: {"description": "the byte range asked for (Range)",
          "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}},
    **documented(400, 401, 404, 409, 416, 503),
}  # fmt: skip


async def read_video_request(
    request: Request, max_part_bytes: int
) -> tuple[VideoCreateRequest, RawImage | None, RawImage | None]:
    """The body's fields, raw first frame and raw video to extend, not decoded yet: multipart as
    `client.videos.create` sends it (the video as a file part `video`), or JSON with `input_reference` a
    data URL or `{"image_url": ...}` and `video` a data URL. Each part is bounded by `max_part_bytes`."""
    body, files = await read_body(
        request, VideoCreateRequest, VIDEO_ACCEPTED_FIELDS, (*_REFERENCE_PARTS, VIDEO_PART), text_only=None,
        empty="request body is required: a JSON object with at least 'prompt' (or multipart)",
        send="application/json or multipart/form-data",
        max_files=2, max_fields=len(VIDEO_ACCEPTED_FIELDS) + 2, max_part_size=max_part_bytes,
    )  # fmt: skip
    if files is None:
        reference = body.input_reference
        if isinstance(reference, ImageReference):
            reference = reference.source("input_reference")
        return body, reference, body.video
    videos = [value for name, value in files if name == VIDEO_PART]
    references = [(name, value) for name, value in files if name != VIDEO_PART]
    if len(videos) > 1:
        raise ApiParamError("video is given more than once", param=VIDEO_PART)
    if videos and body.video is not None:
        raise ApiParamError("video is given both as a file part and as a text field", param=VIDEO_PART)
    if len(references) > 1:
        raise ApiParamError("input_reference is given more than once", param="input_reference")
    for name, value in references:
        if name == "input_reference[file_id]":
            ImageReference(file_id=str(value)).source("input_reference")  # raises: no Files API
    video = videos[0] if videos else body.video
    return body, references[0][1] if references else None, video


def no_content_message(job: VideoJob) -> str:
    """Why a job that is not completed has no MP4: still to come, or never (cancelled, failed and why)."""
    if job.status == "cancelled":
        return f"video {job.id} was cancelled (DELETE); it has no content"
    if job.status == "failed":
        return f"video {job.id} is failed: {job.error_message or job.error_code}; it has no content"
    return (
        f"video {job.id} is {job.status}, not completed; its content is available once status is 'completed'"
    )


def check_route(engine: Engines, video: bool) -> None:
    """Refuse a model of the other kind, naming the route to use. Before the engine is ready /v1/videos
    answers 503; the image routes learn it from the engine client."""
    if not engine.ready:
        if video:
            raise engine.unavailable_error()
        return
    info = engine.engine_info
    message = wrong_route(str(info.get("task", "")), str(info.get("diffusers_pipeline", "this model")), video)
    if message is not None:
        raise ApiError(400, message, param="model", code="unsupported_model")


router = APIRouter()


def check_store(state: AppState) -> None:
    """Reading jobs needs the store, which is opened once the engine reports a video model ready."""
    if not state.video_jobs.is_open:
        check_route(state.engine, video=True)  # an image model: 400 naming its route; not ready: 503
        raise state.engine.unavailable_error()


def found(state: AppState, video_id: str, caller: Principal) -> VideoJob:
    """The job `video_id`, or 404 (a malformed id is never looked up; another client's job does not exist
    for this caller)."""
    check_store(state)
    job = state.video_jobs.get(video_id) if VIDEO_ID_PATTERN.match(video_id) else None
    if job is None or not caller.sees(job.owner):
        message = f"no video with id {video_id!r} on this server (unknown, deleted or expired)"
        raise ApiError(404, message, param="video_id", code="video_not_found")
    return job


@router.post("/v1/videos", responses=_ERRORS, openapi_extra=_create_request_body())
async def create_video(request: Request, state: ServerState, caller: Caller) -> JSONResponse:
    """Create a video job; answers at once with the job (`status: "queued"`). Poll
    `GET /v1/videos/{id}` until `completed`, then download `GET /v1/videos/{id}/content`. With
    `"stream": true` its chunks are published as they are decoded (`GET /v1/videos/{id}/stream`)."""
    try:
        check_route(state.engine, video=True)
        body, reference, video = await read_video_request(request, state.args.max_video_body_bytes)
    except Exception as exc:
        state.count_failure(exc)
        raise
    job = await submit_video(state, caller, body, reference, video)
    return JSONResponse(job.to_api(state.video_jobs.ttl))


async def submit_video(
    state: AppState,
    caller: Principal,
    body: VideoCreateRequest,
    reference: RawImage | None,
    input_video: RawImage | None = None,
) -> VideoJob:
    """Create the job a validated body asks for (POST /v1/videos, /v1/realtime/videos); raises ApiError,
    ApiParamError and what the engine answers, counted as failed submissions. `input_video`: the raw video to
    extend (an upload or a data URL; None: the body's `video` field, if any)."""
    input_video = body.video if input_video is None else input_video
    args, engine, jobs = state.args, state.engine, state.video_jobs
    try:
        check_route(engine, video=True)
        state.check_model(body.model)
        info = engine.engine_info
        task, pipeline = info.get("task"), info.get("diffusers_pipeline", "this model")
        video = info.get("video") or {"temporal_factor": 4, "max_frames": 1025, "max_fps": 120}
        default_fps = int((info.get("default_params") or {}).get("fps") or 16)
        params = body.to_sampling_params(video, default_fps)
        if task == "image-to-video" and reference is None:
            raise ApiParamError(
                f"{pipeline} is an image-to-video model: send the first frame as input_reference (a file "
                'upload, or in JSON a data URL or {"image_url": ...})',
                param="input_reference",
            )
        takes_image = int(info.get("max_input_images") or 0) > 0  # Wan 2.2 TI2V: both tasks
        if task == "text-to-video" and reference is not None and not takes_image:
            raise ApiParamError(
                f"{pipeline} is a text-to-video model and takes no input_reference; animating an image "
                f"needs an image-to-video model ({suggested_pipelines(info, 'image-to-video')})",
                param="input_reference",
            )
        if task == "video-to-video" and input_video is None:
            raise ApiParamError(
                f"{pipeline} extends an input video: send it as video (a file upload, or in JSON a base64 "
                "data URL data:video/mp4;base64,...)",
                param=VIDEO_PART,
            )
        if task != "video-to-video" and input_video is not None:  # refused before the upload is decoded
            raise refuse_input_video(str(pipeline))
        if input_video is not None:
            params.input_video = await load_input_video(
                input_video, args.max_image_bytes, args.max_image_pixels
            )
        if reference is not None:
            check_source("input_reference", reference)
            image = await load_input_image(
                reference, "input_reference", args.allow_url_images, args.image_limits
            )
            params.input_images = [image]
        try:
            i2v, priority = reference is not None, body.priority or 0
            return await jobs.create(
                params, args.model_id, image_to_video=i2v, priority=priority, owner=caller.owner,
                stream=bool(body.stream),
            )  # fmt: skip
        except JobRejectedError as exc:  # named by the field of this route
            exc.param = _PARAM_NAMES.get(exc.param or "", exc.param)
            raise
    except Exception as exc:
        # The manager counts the job's own outcome; this counts a submission that failed.
        state.count_failure(exc)
        raise


async def load_input_video(source: RawImage, max_bytes: int, max_frame_pixels: int) -> list[Image.Image]:
    """The video to extend as RGB frames, decoded in the input-decoding pool (never on the event loop),
    within the upload bounds of an input image (`--max-image-bytes`, `--max-image-pixels` a frame) and
    `diffserve.video_inputs`' frame and total-pixel bounds: InvalidRequestError naming `video` (400; 413
    for the encoded size). No URL is fetched: an upload or a data URL only."""
    if isinstance(source, str) and not source.strip()[:5].lower() == "data:":
        raise ApiParamError(
            "video: expected an uploaded file or a base64 data URL (data:video/mp4;base64,...); the server "
            "fetches no URL and reads no file path",
            param=VIDEO_PART,
        )
    limits = VideoInputLimits(max_bytes=max_bytes, max_frame_pixels=max_frame_pixels)
    try:
        return await DECODE_POOL.run(functools.partial(load_video, source, param=VIDEO_PART, limits=limits))
    except ImageTooLargeError as exc:  # 413, naming the server's bound
        raise ImageTooLargeError(f"{exc} (this server's --max-image-bytes)", param=VIDEO_PART) from None


@router.get("/v1/videos", responses=_ERRORS)
async def list_videos(
    state: ServerState,
    caller: Caller,
    limit: int = Query(DEFAULT_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
    after: str | None = Query(None, description="id of the last job of the previous page"),
    order: Literal["asc", "desc"] = Query("desc", description="by creation time"),
) -> JSONResponse:
    check_store(state)
    jobs = state.video_jobs
    try:
        page, has_more = jobs.list(limit, after, descending=order == "desc", owners=caller.visible_owners())
    except KeyError:
        message = f"after={after!r} is not a video on this server"
        raise ApiError(400, message, param="after", code="invalid_value") from None
    data = [job.to_api(jobs.ttl) for job in page]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return JSONResponse(
        {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}
    )


@router.get("/v1/videos/{video_id}", responses=_ERRORS)
async def retrieve_video(video_id: str, state: ServerState, caller: Caller) -> JSONResponse:
    return JSONResponse(found(state, video_id, caller).to_api(state.video_jobs.ttl))


@router.get("/v1/videos/{video_id}/content", response_class=Response, responses=_CONTENT_RESPONSES)
async def video_content(
    video_id: str, state: ServerState, caller: Caller, variant: str = "video"
) -> ContentFileResponse:
    """The MP4 (`video/mp4`); `Range: bytes=...` requests get 206 with that part."""
    if variant != "video":
        ours = variant in ("thumbnail", "spritesheet")  # OpenAI's other variants
        why = "is not generated by diffserve" if ours else "is not a variant"
        message = f"variant={variant!r} {why}; only 'video' (the MP4) is available"
        raise ApiError(400, message, param="variant", code="invalid_value")
    job = found(state, video_id, caller)
    if job.status != "completed":
        raise ApiError(409, no_content_message(job), param="video_id", code="video_not_ready")
    path = video_file(state.args.output_dir, video_id)
    if not path.is_file():
        raise ApiError(404, f"the file of video {video_id} is gone", param="video_id", code="video_not_found")
    return ContentFileResponse(
        path, media_type="video/mp4", filename=path.name, content_disposition_type="inline"
    )


@router.delete("/v1/videos/{video_id}", responses=_ERRORS)
async def delete_video(video_id: str, state: ServerState, caller: Caller) -> JSONResponse:
    """Cancel a job in flight (its record stays, `cancelled`, until it expires or is deleted again) or
    delete a finished job and its file."""
    found(state, video_id, caller)
    if await state.video_jobs.delete(video_id) is None:
        found(state, video_id, caller)  # raced with expiry: 404
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})
