"""Messages between the HTTP front end and the engine process (pickled over ZeroMQ).

Front end -> engine: `GenerateJob`, `CancelJob`, `ShutdownEngine`.
Engine -> front end: every message is sent as `(incarnation, message)`, where `incarnation` counts engine
(re)starts, so a message still in flight from an engine that died is recognised and dropped.

    GenerateJob ──► JobRejected (bad parameters, or too large to ever fit in memory: never queued)
                └─► [JobAccepted] ─► JobStarted ─► [JobProgress | JobPreview...] ─► JobFinished | JobCancelled | JobFailed
                                  └─► JobCancelled (cancelled while still waiting)

JobAccepted is sent only for jobs with `ack` (video jobs: their POST answers once the engine has
validated them), always before JobStarted. JobStarted is sent when the engine's scheduler admits the
job into its running set (several jobs run at once, sharing denoising steps). JobProgress is sent for
every job: one per denoising step, then one at each later phase (VAE decoding; MP4 encoding for video
jobs). JobPreview is sent only for jobs with `partial_images` > 0, at evenly spaced steps.

Both ends run the same code version and the sockets live in a private temporary directory, so pickle
is safe here and keeps `SamplingParams` and bytes intact without a schema layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from diffserve.configs.sampling_params import SamplingParams


# Front end -> engine.
@dataclass
class GenerateJob:
    request_id: str
    #: For edits, `input_images` / `mask_image` hold the decoded PIL images (they pickle as raw pixels).
    params: SamplingParams
    #: "b64_json": encoded bytes come back in the message; "url": the engine writes files to the output dir.
    response_format: Literal["b64_json", "url"] = "b64_json"
    #: Quality (0-100) for jpeg and webp; None: 100, OpenAI's default.
    output_compression: int | None = None
    #: /health_generate's probe: exempt from --max-queue-size and the queue-time metric.
    internal: bool = False
    #: A /v1/videos job: the engine reports JobProgress and writes the MP4 to this path (in its encoder
    #: thread) instead of encoding images. None: an image request.
    video_path: str | None = None
    #: Answer JobAccepted once the parameters are validated and the job is queued.
    ack: bool = False
    #: Scheduling priority: higher is admitted first, equal priorities in arrival order (FCFS).
    priority: int = 0
    #: Streamed image requests: how many previews (0-3) of the predicted clean image the engine sends
    #: as JobPreview, at evenly spaced denoising steps.
    partial_images: int = 0


@dataclass
class CancelJob:
    request_id: str


@dataclass
class ShutdownEngine:
    pass


# Engine -> front end.
@dataclass
class EngineReady:
    """The model is loaded and warmed up; `info` is shown by /server_info."""

    pid: int
    info: dict[str, Any]
    #: Side in pixels of the small image warm-up and /health_generate draw (a valid size for this model).
    probe_size: int


@dataclass
class EngineFatal:
    """The engine cannot start (model folder, device, ...). `user_error`: the user can fix it."""

    message: str
    user_error: bool


@dataclass
class JobRejected:
    """Invalid parameters, found before queueing; the message says which and what is allowed."""

    request_id: str
    message: str
    param: str | None = None
    #: HTTP status the front end answers: 400 (invalid), or 413 (needs more memory than the engine has,
    #: even alone; the message gives the estimate and the budget).
    status: int = 400


@dataclass
class JobAccepted:
    """Validated and queued (only for jobs with `ack`); `params` are resolved (family defaults applied,
    input images left out), so the front end can show the size, frames and steps that will be used."""

    request_id: str
    params: SamplingParams


@dataclass
class JobStarted:
    request_id: str


#: What a video job is doing: denoising steps, then VAE decoding, then MP4 encoding.
ProgressPhase = Literal["denoising", "decoding", "encoding"]


@dataclass
class JobProgress:
    """`step` of `total` denoising steps are done; `phase` is what the engine does now."""

    request_id: str
    step: int
    total: int
    phase: ProgressPhase


@dataclass
class JobPreview:
    """Preview number `index` (0-based) of a streamed job, made after denoising step `step` of
    `total_steps` from the predicted clean latent (`diffserve.stages.previews`): one PNG per output."""

    request_id: str
    index: int
    step: int
    total_steps: int
    images: list[bytes]


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
    #: Requests in the DiT batch of each of this job's denoising steps (1: the step ran alone).
    batch_sizes: list[int] = field(default_factory=list)
    #: Steps that ran every DiT block (fewer than the steps with an approximate quality tier).
    steps_computed_in_full: int | None = None


@dataclass
class JobCancelled:
    request_id: str
    at_step: int | None = None  # None: cancelled before it started


@dataclass
class JobFailed:
    """An unexpected error inside one request; the engine logged the traceback and carries on."""

    request_id: str
    message: str
    user_error: bool = False
