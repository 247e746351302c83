"""Messages between the HTTP front end and the engine process (pickled over ZeroMQ).

Front end -> engine: `GenerateJob`, `CancelJob`, `ShutdownEngine`, and the LoRA admin ops `LoadLora`,
`UnloadLora`, `ListLoras`. Engine -> front end: each message as `(incarnation, message)`, `incarnation`
counting engine (re)starts, so a message still in flight from an engine that died is recognised and
dropped; once ready, an `EngineHeartbeat` every second.

    GenerateJob ──► JobRejected (bad parameters, or too large to ever fit in memory: never queued)
                └─► [JobAccepted] ─► JobStarted ─► [JobProgress | JobPreview | JobChunk...] ─► JobFinished | JobCancelled | JobFailed
                                  └─► JobCancelled (cancelled while still waiting)
    LoadLora | UnloadLora | ListLoras ──► LoraOpDone | LoraOpFailed  (matched by `op_id`)

Both ends run the same code and the sockets live in a private directory, so pickle is safe here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from diffserve.configs.sampling_params import SamplingParams
from diffserve.phases import Handoff, PhaseSpan

VIDEO_TASKS = ("text-to-video", "image-to-video", "video-to-video")


def wrong_route(task: str, pipeline: str, video: bool) -> str | None:
    """Why a model of `task` cannot serve a request for videos (`video`) or images, naming the route to
    use; None when it can."""
    if (makes_video := task in VIDEO_TASKS) == video:
        return None
    serves = f"this server serves {pipeline}, a {task} model"
    if makes_video:
        return f"{serves}: it generates videos, not images; use POST /v1/videos"
    route = "/v1/images/edits" if task == "image-edit" else "/v1/images/generations"
    return f"{serves}: it generates images, not videos; use POST {route}"


# Front end -> engine.
@dataclass
class GenerateJob:
    request_id: str
    params: SamplingParams  # edits: `input_images` / `mask_image` are decoded PIL images
    #: "b64_json": encoded bytes come back in the message; "url": the engine writes files to the output dir.
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_compression: int | None = None  # jpeg and webp quality (0-100); None: 100, OpenAI's default
    internal: bool = False  # /health_generate's probe: left out of the queue-time metric
    video_path: str | None = None  # a /v1/videos job: the engine writes the MP4 here
    #: A /v1/videos job with `stream`: its MP4 is fragmented, one segment per VAE chunk, each sent as a
    #: `JobChunk` as soon as it is in the file (outputs/fmp4.py).
    stream_chunks: bool = False
    ack: bool = False  # answer JobAccepted once the parameters are validated and the job is queued
    priority: int = 0  # higher is admitted first, equal priorities in arrival order
    partial_images: int = 0  # streamed images: previews sent as JobPreview, at evenly spaced steps
    #: The phases the engine runs for this job (phases.py; None: all of them). Disaggregated serving
    #: (deploy/disaggregated.py): a job whose span starts after encode brings its request as `handoff`;
    #: one whose span ends before decode is answered with its request for the next phase (`JobFinished`).
    phases: PhaseSpan | None = None
    handoff: Handoff | None = None


@dataclass
class CancelJob:
    request_id: str


@dataclass
class ShutdownEngine:
    pass


# Front end -> engine: LoRA admin ops (`POST/GET/DELETE /v1/loras`, server/lora_routes.py), each answered by
# a LoraOpDone or a LoraOpFailed with its `op_id`. The engine runs loads and unloads between two steps.
@dataclass
class LoadLora:
    op_id: str
    name: str
    path: str  # relative to --lora-dir: the engine refuses anything that resolves outside it
    strict: bool = True  # False: apply what matches the model and log what is ignored
    lazy: bool = False  # True: known now, read when a request names it (a restarted engine's replay)


@dataclass
class UnloadLora:
    op_id: str
    name: str


@dataclass
class ListLoras:
    op_id: str


# Engine -> front end.
@dataclass
class EngineReady:
    """The model is loaded and warmed up; `info` is shown by /server_info."""

    pid: int
    info: dict[str, Any]
    probe_size: int  # side in pixels of the warm-up's and /health_generate's images (valid for this model)


@dataclass
class EngineHeartbeat:
    """Sent every second once ready (`engine_liveness.py`): the longest turn in progress of the engine
    loop, the receiver or an admission, for the front end's watchdog (`--engine-watchdog-seconds`)."""

    stalled_seconds: float  # how long that turn has lasted: near 0 for an engine that makes progress
    doing: str  # what it is, for the log line and /health's 503 when the engine is restarted for it


@dataclass
class EngineFatal:
    message: str  # why the engine cannot start (model folder, device, ...)
    user_error: bool  # the user can fix it


@dataclass
class JobRejected:
    request_id: str
    message: str
    param: str | None = None
    status: int = 400  # the front end's answer: 400, or 413 when it needs more memory than the engine has


@dataclass
class JobAccepted:
    """Validated and queued (only for jobs with `ack`); `params` resolved, without the input images."""

    request_id: str
    params: SamplingParams


@dataclass
class JobStarted:
    request_id: str


@dataclass
class JobProgress:
    request_id: str
    step: int
    total: int
    phase: Literal["denoising", "decoding", "encoding"]  # encoding: writing a video job's MP4


@dataclass
class JobPreview:
    """Preview `index` (0-based) of a streamed job after step `step`: one PNG per output."""

    request_id: str
    index: int
    step: int
    total_steps: int
    images: list[bytes]


@dataclass
class JobChunk:
    """Chunk `index` of a streamed video job (`GenerateJob.stream_chunks`): its frames as a fragmented-MP4
    media segment, written to the job's file before this is sent. The first chunk brings the init segment
    and its MediaSource type; the file is the init segment and every chunk's segment, in order."""

    request_id: str
    index: int
    start_frame: int
    num_frames: int
    fps: int
    data: bytes
    init: bytes | None = None
    mime_type: str | None = None


@dataclass
class EncodedVideo:
    path: str  # the MP4, written atomically (complete once this message is sent)
    size_bytes: int
    num_frames: int
    width: int
    height: int
    fps: int


@dataclass
class EncodedImage:
    data: bytes | None  # the encoded file (b64_json); None when written to disk (url)
    image_id: str  # `{request_id}-{index}`: the file name stem under the output dir
    content_type: str


@dataclass
class JobFinished:
    request_id: str
    images: list[EncodedImage]
    params: SamplingParams  # resolved: family defaults applied; input_images and mask_image left out
    timings: dict[str, float]  # seconds per stage
    step_times: list[float]
    peak_memory_bytes: int | None
    engine_seconds: float  # start of generation to encoded images
    encode_seconds: float
    videos: list[EncodedVideo] = field(default_factory=list)  # video jobs (then `images` is empty)
    batch_sizes: list[int] = field(default_factory=list)  # requests in the DiT batch of each of its steps
    steps_computed_in_full: int | None = None  # fewer than the steps with an approximate quality tier
    #: A cache method's or tier's report (`Req.cache_report`: method, settings, steps and blocks computed vs
    #: reused); None on the exact path.
    cache: dict[str, Any] | None = None
    #: A job whose phases end before decode (`GenerateJob.phases`): its request for the next phase, in
    #: place of images.
    handoff: Handoff | None = None
    #: The engine's batch policy when it finished (`BatchPolicy.describe`: the policy, the measured step
    #: seconds per token bucket and rows, the last decision's reason): /server_info's and the metrics'.
    batching: dict[str, Any] | None = None


@dataclass
class JobCancelled:
    request_id: str
    at_step: int | None = None  # None: cancelled before it started


@dataclass
class JobFailed:
    request_id: str
    message: str
    user_error: bool = False
    param: str | None = None  # a user error's request field, when the engine knows it (e.g. `loras`)


@dataclass
class LoraOpDone:
    op_id: str
    loras: dict[str, Any]  # the engine's LoRA state after the op, as /server_info shows it (`loras` block)
    adapter: dict[str, Any] | None = None  # LoadLora: the adapter loaded (`LoraInfo.to_dict()`)


@dataclass
class LoraOpFailed:
    op_id: str
    message: str
    status: int  # the front end's answer: 400, 404 (unknown adapter), 409 (in use, name taken) or 500
    param: str | None = None
    code: str | None = None
