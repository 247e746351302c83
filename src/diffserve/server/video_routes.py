"""`/v1/videos`: OpenAI's video API (as SGLang and vLLM-Omni serve it) over `VideoJobManager`.

    POST   /v1/videos                 create a job (JSON or multipart, as `client.videos.create` sends it)
    GET    /v1/videos                 list jobs (`limit`, `after`, `order`), newest first
    GET    /v1/videos/{id}            one job: status, progress, error
    GET    /v1/videos/{id}/content    the MP4 (`variant=video`), with HTTP Range support
    DELETE /v1/videos/{id}            cancel a job in flight, or delete a finished one

Request fields: OpenAI's `prompt`, `model`, `size` ("WxH"), `seconds`, `input_reference` (the first frame,
for image-to-video models), and diffserve's extensions `num_frames`, `fps`, `seed`, `negative_prompt`,
`num_inference_steps`, `guidance_scale`, `max_sequence_length`. `seconds` becomes the nearest valid frame
count (`frames_for_seconds`); it and `num_frames` exclude each other. Everything the front end can check
without the model is checked here; the rest (sizes, frame counts, ranges) by the engine before the job is
accepted, so every invalid job is a 400 from the POST itself.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile

from diffserve.configs.sampling_params import SamplingParams
from diffserve.image_inputs import load_image
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient, JobRejectedError
from diffserve.server.errors import ApiError, validation_error_message
from diffserve.server.metrics import ServerMetrics
from diffserve.server.schemas import ApiParamError, ErrorResponse, ImageReference
from diffserve.server.video_jobs import VIDEO_ID_PATTERN, VideoJob, VideoJobManager, video_file

VIDEO_TASKS = ("text-to-video", "image-to-video")
#: Largest side a video may ask for; beyond it a request is refused before it reaches the engine.
MAX_VIDEO_SIDE = 4096
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
_STRING_SCHEMES = ("data:", "http://", "https://")
#: Engine parameter names -> the request field a client of this route set.
_PARAM_NAMES = {"height": "size", "width": "size", "image": "input_reference"}

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 429, 503)
}


class VideoCreateRequest(BaseModel):
    """`POST /v1/videos`: OpenAI's fields, then diffserve's extensions; nothing else."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = Field(None, description="the served model's id or an alias (--served-model-name)")
    size: str | None = Field(None, description="'WIDTHxHEIGHT'; unset: the model's default")
    seconds: float | None = Field(
        None, gt=0, description="clip length (string or number); excludes num_frames"
    )
    input_reference: str | ImageReference | None = Field(
        None,
        description="the first frame (image-to-video models): an uploaded file, or a data URL / {image_url}",
    )
    # diffserve extensions (SamplingParams fields); unset: the model's defaults.
    num_frames: int | None = Field(None, ge=1, description="frames to generate (Wan: 4k+1); excludes seconds")
    fps: int | None = Field(
        None, ge=1, description="frame rate of the MP4 (default: the model's, 16 for Wan)"
    )
    seed: int | None = Field(None, ge=0, lt=2**63, description="unset: a random seed, returned in the job")
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0)
    max_sequence_length: int | None = Field(None, ge=1)
    quality: str | None = Field(
        None,
        description="'lossless' (exact), 'high', 'medium', 'low' (approximate, faster) or 'auto' (the "
        "server's --default-quality); see /v1/images/generations",
    )
    priority: int | None = Field(
        None,
        ge=-1000,
        le=1000,
        description="scheduling priority (-1000..1000, default 0): the engine admits higher first, equal "
        "priorities first come first served",
    )

    def video_size(self) -> tuple[int | None, int | None]:
        if self.size is None or self.size.strip() == "auto":
            return None, None
        match = _SIZE.match(self.size)
        if match is None:
            raise ApiParamError(
                f"size must be 'WIDTHxHEIGHT' (for example '832x480'), got {self.size!r}", param="size"
            )
        width, height = int(match.group(1)), int(match.group(2))
        if not (0 < width <= MAX_VIDEO_SIDE and 0 < height <= MAX_VIDEO_SIDE):
            raise ApiParamError(
                f"size {self.size!r} is out of range: each side must be 1..{MAX_VIDEO_SIDE} pixels",
                param="size",
            )
        return width, height

    def to_sampling_params(self, video: dict[str, int], default_fps: int) -> SamplingParams:
        """The engine's parameters (raises ApiParamError). `video`: the model's frame rules (engine info)."""
        width, height = self.video_size()
        num_frames = self.num_frames
        if self.seconds is not None:
            if self.num_frames is not None:
                raise ApiParamError("pass either seconds or num_frames, not both", param="seconds")
            fps = self.fps or default_fps
            num_frames = frames_for_seconds(self.seconds, fps, video["temporal_factor"])
            if num_frames > video["max_frames"]:
                longest = (video["max_frames"]) / fps
                raise ApiParamError(
                    f"seconds={self.seconds:g} at {fps} fps is {num_frames} frames; this model makes at most "
                    f"{video['max_frames']} frames ({longest:g} s at {fps} fps)",
                    param="seconds",
                )
        return SamplingParams(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            height=height,
            width=width,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            seed=self.seed if self.seed is not None else secrets.randbelow(2**32),
            max_sequence_length=self.max_sequence_length,
            num_frames=num_frames,
            fps=self.fps,
            video_format="mp4",
            quality=self.quality,
        )


VIDEO_ACCEPTED_FIELDS: tuple[str, ...] = tuple(VideoCreateRequest.model_fields)


def frames_for_seconds(seconds: float, fps: int, temporal_factor: int) -> int:
    """The valid frame count (temporal_factor * k + 1) nearest to `seconds * fps`; ties go to the longer
    clip. At least 1 frame. Wan (factor 4) at 16 fps: 4 s -> 65 frames, 5 s -> 81."""
    exact = seconds * fps
    k = math.floor((exact - 1) / temporal_factor + 0.5 + 1e-9)
    return max(k, 0) * temporal_factor + 1


def _validate(fields: Any) -> VideoCreateRequest:
    try:
        return VideoCreateRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_error_message(list(exc.errors()), VIDEO_ACCEPTED_FIELDS)
        raise ApiError(
            400, message, param=param, code="invalid_value" if param else "invalid_request"
        ) from None


async def read_video_request(
    request: Request, max_part_bytes: int
) -> tuple[VideoCreateRequest, bytes | str | None]:
    """The body as fields and the raw first-frame image (upload bytes or a URL string), not decoded yet.

    Multipart is what `client.videos.create` sends (every field a text part, `input_reference` a file part,
    or `input_reference[image_url]` for its JSON-object form); JSON takes `input_reference` as a data URL
    string or `{"image_url": ...}`."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type in _FORM_TYPES:
        async with request.form(
            max_files=1, max_fields=len(VIDEO_ACCEPTED_FIELDS) + 2, max_part_size=max_part_bytes
        ) as form:
            fields: dict[str, Any] = {}
            reference: bytes | str | None = None
            for name, value in form.multi_items():
                if name in ("input_reference", "input_reference[image_url]", "input_reference[file_id]"):
                    if reference is not None:
                        raise ApiParamError(
                            "input_reference is given more than once", param="input_reference"
                        )
                    if name == "input_reference[file_id]":
                        ImageReference(file_id=str(value)).source("input_reference")  # raises: no Files API
                    reference = await value.read() if isinstance(value, UploadFile) else value
                elif name in fields:
                    raise ApiParamError(f"{name} is given more than once", param=name)
                elif isinstance(value, UploadFile):
                    raise ApiParamError(f"{name} must be a text field, not a file", param=name)
                else:
                    fields[name] = value
        return _validate(fields), reference
    if media_type in ("application/json", ""):
        raw = await request.body()
        if not raw:
            raise ApiError(
                400,
                "request body is required: a JSON object with at least 'prompt' (or multipart)",
                code="invalid_request",
            )
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON ({exc})", code="invalid_request") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_request")
        body = _validate(data)
        reference = body.input_reference
        if isinstance(reference, ImageReference):
            reference = reference.source("input_reference")
        return body, reference
    raise ApiError(
        415,
        f"Content-Type {media_type!r} is not supported; send application/json or multipart/form-data",
        code="unsupported_media_type",
    )


def _model_kind(engine: EngineClient) -> tuple[str, str]:
    """(task, pipeline) of the loaded model; 503 while the engine is not ready (its info is unknown)."""
    if not engine.ready:
        raise engine.unavailable_error()
    info = engine.engine_info
    return str(info.get("task", "")), str(info.get("diffusers_pipeline", "this model"))


def check_image_model(engine: EngineClient) -> None:
    """The image routes refuse a video model with a pointer to /v1/videos (no-op while not ready)."""
    if not engine.ready:
        return
    task, pipeline = _model_kind(engine)
    if task in VIDEO_TASKS:
        raise ApiError(
            400,
            f"this server serves {pipeline}, a {task} model: it generates videos, not images; "
            "use POST /v1/videos",
            param="model",
            code="unsupported_model",
        )


def video_router(
    args: ServerArgs,
    engine: EngineClient,
    jobs: VideoJobManager,
    metrics: ServerMetrics,
    check_model: Callable[[str | None], None],
    outcome_of: Callable[[Exception], str],
) -> APIRouter:
    """The routes; `check_model` 404s a `model` not served here, `outcome_of` labels a failed submission
    in `diffserve_generation_requests_total` (the job's own outcome is counted by the manager)."""
    router = APIRouter()

    def found(video_id: str) -> VideoJob:
        job = jobs.get(video_id) if VIDEO_ID_PATTERN.match(video_id) else None
        if job is None:
            raise ApiError(
                404,
                f"no video with id {video_id!r} on this server (unknown, deleted or expired)",
                param="video_id",
                code="video_not_found",
            )
        return job

    def respond(job: VideoJob) -> JSONResponse:
        return JSONResponse(job.to_api(jobs.ttl))

    @router.post("/v1/videos", responses={**_ERRORS, 415: _ERRORS[400]})
    async def create_video(request: Request) -> JSONResponse:
        """Create a video job; answers at once with the job (`status: "queued"`). Poll
        `GET /v1/videos/{id}` until `completed`, then download `GET /v1/videos/{id}/content`."""
        try:
            task, pipeline = _model_kind(engine)
            if task not in VIDEO_TASKS:
                other = "/v1/images/edits" if task == "image-edit" else "/v1/images/generations"
                raise ApiError(
                    400,
                    f"this server serves {pipeline}, a {task} model: it generates images, not "
                    f"videos; use POST {other}",
                    param="model",
                    code="unsupported_model",
                )
            body, reference = await read_video_request(request, args.max_video_body_bytes)
            check_model(body.model)
            info = engine.engine_info
            video = info.get("video") or {"temporal_factor": 4, "max_frames": 1025, "max_fps": 120}
            default_fps = int((info.get("default_params") or {}).get("fps") or 16)
            params = body.to_sampling_params(video, default_fps)
            if task == "image-to-video" and reference is None:
                raise ApiParamError(
                    f"{pipeline} is an image-to-video model: send the first frame as input_reference (a file "
                    'upload, or in JSON a data URL or {"image_url": ...})',
                    param="input_reference",
                )
            if task == "text-to-video" and reference is not None:
                raise ApiParamError(
                    f"{pipeline} is a text-to-video model and takes no input_reference; animating an image "
                    "needs an image-to-video model such as WanImageToVideoPipeline",
                    param="input_reference",
                )
            if isinstance(reference, str) and not reference.strip()[:16].lower().startswith(_STRING_SCHEMES):
                raise ApiParamError(
                    "input_reference: expected an uploaded file, a base64 data URL "
                    "(data:image/png;base64,...) or an http(s) URL",
                    param="input_reference",
                )
            if reference is not None:
                image = await asyncio.to_thread(
                    load_image,
                    reference,
                    param="input_reference",
                    allow_urls=args.allow_url_images,
                    limits=args.image_limits,
                )
                params.input_images = [image]
            try:
                job = await jobs.create(
                    params, args.model_id, image_to_video=reference is not None, priority=body.priority or 0
                )
            except JobRejectedError as exc:
                param = _PARAM_NAMES.get(exc.param or "", exc.param)
                code = "request_too_large" if exc.status == 413 else "invalid_value"
                raise ApiError(exc.status, str(exc), param=param, code=code) from None
        except Exception as exc:
            metrics.generation_requests.labels(outcome_of(exc)).inc()
            raise
        return respond(job)

    @router.get("/v1/videos", responses=_ERRORS)
    async def list_videos(
        limit: int = Query(DEFAULT_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
        after: str | None = Query(None, description="id of the last job of the previous page"),
        order: Literal["asc", "desc"] = Query("desc", description="by creation time"),
    ) -> JSONResponse:
        try:
            page, has_more = jobs.list(limit, after, descending=order == "desc")
        except KeyError:
            raise ApiError(
                400, f"after={after!r} is not a video on this server", param="after", code="invalid_value"
            ) from None
        data = [job.to_api(jobs.ttl) for job in page]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": has_more,
            }
        )

    @router.get("/v1/videos/{video_id}", responses=_ERRORS)
    async def retrieve_video(video_id: str) -> JSONResponse:
        return respond(found(video_id))

    @router.get("/v1/videos/{video_id}/content", responses=_ERRORS)
    async def video_content(video_id: str, variant: str = "video") -> FileResponse:
        """The MP4 (`video/mp4`); `Range: bytes=...` requests get 206 with that part."""
        if variant != "video":
            why = (
                "is not generated by diffserve"
                if variant in ("thumbnail", "spritesheet")
                else "is not a variant"
            )
            raise ApiError(
                400,
                f"variant={variant!r} {why}; only 'video' (the MP4) is available",
                param="variant",
                code="invalid_value",
            )
        job = found(video_id)
        if job.status != "completed":
            detail = f": {job.error_message}" if job.error_message else ""
            raise ApiError(
                409,
                f"video {video_id} is {job.status}, not completed{detail}; its content is "
                "available once status is 'completed'",
                param="video_id",
                code="video_not_ready",
            )
        path = video_file(args.output_dir, video_id)
        if not path.is_file():
            raise ApiError(
                404, f"the file of video {video_id} is gone", param="video_id", code="video_not_found"
            )
        return FileResponse(
            path, media_type="video/mp4", filename=f"{video_id}.mp4", content_disposition_type="inline"
        )

    @router.delete("/v1/videos/{video_id}", responses=_ERRORS)
    async def delete_video(video_id: str) -> JSONResponse:
        """Cancel a queued or running job (it stops at its next denoising step; the record stays, as
        `cancelled`, until it expires or is deleted again) or delete a finished job and its file."""
        found(video_id)
        job = await jobs.delete(video_id)
        if job is None:
            found(video_id)  # raced with expiry: 404
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    return router
