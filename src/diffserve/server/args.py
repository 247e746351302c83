"""Server-wide settings of `diffserve serve`, next to the engine's own `EngineArgs`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diffserve.configs.engine_args import EngineArgs
from diffserve.image_inputs import ImageInputLimits

#: Input images (plus one mask) a request of /v1/images/edits may carry; OpenAI's limit.
MAX_INPUT_IMAGES = 16


@dataclass
class ServerArgs:
    engine_args: EngineArgs
    host: str = "127.0.0.1"
    port: int = 30000
    #: Required as `Authorization: Bearer KEY` on every route but /health, /health_generate, /metrics.
    api_key: str | None = None
    #: Names clients may pass as `model`; the first is the id /v1/models reports. Empty: the folder's name.
    served_model_names: list[str] = field(default_factory=list)
    #: Requests waiting for the engine before new ones get 429 (the engine's own limits are in `engine_args`).
    max_queue_size: int = 64
    max_body_bytes: int = 1 << 20
    #: Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    shutdown_timeout: float = 30.0
    warmup: bool = True
    log_level: str = "info"
    #: Consecutive failed engine restarts before the server gives up (and /health stays 503).
    max_engine_restarts: int = 5
    #: Fetch input images from http(s) URLs (public hosts only); off, the server makes no outbound requests.
    allow_url_images: bool = False
    #: Largest encoded input image (upload, decoded data URL or download); larger ones get 413.
    max_image_bytes: int = 20 << 20
    #: Largest input image in pixels (width * height, read from the header before decoding); 413 above.
    max_image_pixels: int = 4096 * 4096
    #: Seconds one input-image download may take in all (connect, TLS, headers, body); then a 400.
    url_fetch_timeout: float = 10.0
    #: Seconds a finished /v1/videos job (and its MP4) is kept after it finished; then it is deleted.
    job_ttl: float = 86400.0
    #: Seconds between the progress lines of a long request in the log.
    log_progress_interval: float = 5.0
    #: The server's address as clients reach it (`https://img.example.com`), for the image URLs of
    #: response_format="url"; unset, the request's own scheme and Host header are used.
    public_url: str | None = None
    #: Data-parallel replicas: engine processes, each with its own copy of the model, behind this front
    #: end, which sends each request to the least-loaded ready one (`server/replicas.py`).
    dp_size: int = 1
    #: Serve the web playground at `/` (webui_routes.py); `--no-webui` leaves it out.
    webui: bool = True

    @property
    def model_id(self) -> str:
        """What /v1/models lists: the first served name, else the model folder's (or repo id's) last part,
        as OpenAI ids are names (`shapes-demo`, `FLUX.1-dev`), not paths of the server's disk."""
        if self.served_model_names:
            return self.served_model_names[0]
        return Path(self.engine_args.model_path).name or self.engine_args.model_path

    @property
    def model_aliases(self) -> set[str]:
        """Every `model` value a request may name: the served names, the model path and its folder name."""
        path = self.engine_args.model_path
        return {*self.served_model_names, path, Path(path).name}

    @property
    def image_limits(self) -> ImageInputLimits:
        return ImageInputLimits(
            max_bytes=self.max_image_bytes,
            max_pixels=self.max_image_pixels,
            url_timeout_s=self.url_fetch_timeout,
        )

    # The body limits of the routes that take images: room for their images at `max_image_bytes` each as
    # base64 data URLs (4/3 larger than uploads), plus `max_body_bytes` for the other fields and framing.
    @property
    def max_edit_body_bytes(self) -> int:
        """/v1/images/edits before the served model is known: MAX_INPUT_IMAGES images and a mask. Once
        the engine has reported the model, the route holds a body to `image_body_bytes` of the number
        of images the model takes (`max_body_bytes` for a model that takes none)."""
        return self.image_body_bytes(MAX_INPUT_IMAGES + 1)

    @property
    def max_video_body_bytes(self) -> int:
        """POST /v1/videos: one first frame."""
        return self.image_body_bytes(1)

    def image_body_bytes(self, images: int) -> int:
        """A body with room for `images` input images; `max_body_bytes`, as generations, for none."""
        return images * -(-self.max_image_bytes * 4 // 3) + self.max_body_bytes

    @property
    def devices_per_replica(self) -> int:
        """Accelerators one replica's engine uses on this machine (its ranks here: `--num-gpus` over
        `--nnodes`); replica i starts at device index i x this."""
        return self.engine_args.parallel_config().ranks_per_node

    @property
    def output_dir(self) -> Path:
        return Path(self.engine_args.output_path)

    def to_dict(self) -> dict[str, Any]:
        """For /server_info: everything but the API key itself."""
        out = asdict(self)
        out["api_key"] = "set" if self.api_key else None
        return out
