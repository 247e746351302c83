"""Server-wide settings of `diffserve serve`, next to the engine's own `EngineArgs`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.option import option
from diffserve.errors import UserError
from diffserve.logging_setup import LEVELS

if TYPE_CHECKING:  # the CLI reads these declarations: it need not load the image decoders
    from diffserve.image_inputs import ImageInputLimits

#: Input images (plus one mask) a request of /v1/images/edits may carry; OpenAI's limit.
MAX_INPUT_IMAGES = 16


def check_public_url(url: str, flag: str = "--public-url") -> str:
    """An absolute http(s) URL with a host and no query or fragment, without a trailing /."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise UserError(f"{flag} must be an http(s) URL such as https://img.example.com, got {url!r}")
    return parts.geturl().rstrip("/")


def check_api_key(key: str, flag: str) -> str:
    if not key.strip() or (flag == "--api-key" and not all(k.strip() for k in key.split(","))):
        raise UserError(f"{flag} must not be empty (nor hold an empty key between commas)")
    return key


@dataclass
class ServerArgs:
    """What `diffserve serve` runs with besides the engine's `EngineArgs`. Each field but `engine_args` is
    declared once (`configs/option.py`): `serve`'s flags are made from these declarations."""

    engine_args: EngineArgs
    host: str = option(
        "127.0.0.1", cli="--host", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)"
    )
    port: int = option(30000, cli="--port", min=0, max=65535, help="port to listen on (default: 30000)")
    #: Required as `Authorization: Bearer KEY` on every route but /health, /health_generate, /metrics.
    #: Several keys (comma-separated): one per client; each sees only its own /v1/videos jobs (access.py).
    api_key: str | None = option(
        None, cli="--api-key", env="DIFFSERVE_API_KEY", convert=check_api_key,
        help="require 'Authorization: Bearer KEY' but on /health* and /metrics; several keys separated by "
        "commas, one per client: each sees only the /v1/videos jobs it created (default: $DIFFSERVE_API_KEY)",
    )  # fmt: skip
    #: access.py: the admin routes need it; it sees every job; only its callers see server paths.
    admin_api_key: str | None = option(
        None, cli="--admin-api-key", env="DIFFSERVE_ADMIN_API_KEY", convert=check_api_key,
        help="the key of the admin routes (POST and DELETE /v1/loras), which then refuse --api-key keys; it "
        "also sees every client's /v1/videos jobs, and only its callers see server paths in responses and "
        "/server_info (default: $DIFFSERVE_ADMIN_API_KEY; unset: every --api-key key is an admin key)",
    )  # fmt: skip
    #: The first is the id /v1/models reports. Empty: the folder's name.
    served_model_names: list[str] = option(
        default_factory=list, cli="--served-model-name", metavar="NAME",
        help="name(s) clients pass as 'model'; /v1/models lists the first (default: the model path)",
    )  # fmt: skip
    #: The engine's own limits are in `engine_args`.
    max_queue_size: int = option(
        64, cli="--max-queue-size", min=0,
        help="requests allowed to wait (not counting running ones, nor those free running slots take "
        "next); more get 429 (default: 64)",
    )  # fmt: skip
    max_body_bytes: int = option(
        1 << 20, cli="--max-body-bytes", min=1,
        help="largest request body, beyond /v1/images/edits' images; larger: 413 (default: 1048576)",
    )  # fmt: skip
    #: Then in-flight requests are cancelled.
    shutdown_timeout: float = option(
        30.0, cli="--shutdown-timeout", min=0,
        help="on SIGTERM or Ctrl-C, seconds requests in flight and /v1/videos jobs get to finish before they "
        "are cancelled; a second signal stops at once (default: 30)",
    )  # fmt: skip
    warmup: bool = option(
        True, cli="--warmup", help="run a 1-step generation before reporting ready (default: on)"
    )
    #: The process's; `generate` and `calibrate-cache` have the flag too.
    log_level: str = option(
        "info", cli="--log-level", choices=LEVELS, metavar="LEVEL",
        help=f"log verbosity: {', '.join(LEVELS)}; debug also prints the traceback of an error (default: info)",
    )  # fmt: skip
    #: Then /health stays 503.
    max_engine_restarts: int = option(
        5, min=0, help="consecutive failed engine restarts before the server gives up"
    )
    #: engine_client.py's watchdog over the engine's heartbeat (engine_liveness.py).
    engine_watchdog_seconds: float = option(
        600.0, cli="--engine-watchdog-seconds", min=0,
        help="restart an engine that is stuck: one step, message or admission of it lasting this many "
        "seconds, or this long without its heartbeat (/health says so; requests in flight get 503 "
        "engine_died). Generous: one step of a large video model can take a minute, a --compile "
        "recompilation several; 0: never (default: 600)",
    )  # fmt: skip
    #: Off, the server makes no outbound requests.
    allow_url_images: bool = option(
        False, cli="--allow-url-images",
        help="let /v1/images/edits fetch input images from public http(s) URLs (default: off)",
    )  # fmt: skip
    #: An upload, a decoded data URL or a download.
    max_image_bytes: int = option(
        20 << 20, cli="--max-image-bytes", min=1,
        help="largest encoded input image; larger ones get 413 (default: 20971520 = 20 MiB)",
    )  # fmt: skip
    #: Width * height, read from the header before decoding.
    max_image_pixels: int = option(
        4096 * 4096, cli="--max-image-pixels", min=1,
        help="largest input image in pixels, checked before decoding; larger: 413 (default: 4096x4096)",
    )  # fmt: skip
    #: Connect, TLS, headers and body in all.
    url_fetch_timeout: float = option(
        10.0, cli="--url-fetch-timeout", gt=0,
        help="with --allow-url-images: seconds one input-image download may take in all; then 400 (default: 10)",
    )  # fmt: skip
    job_ttl: float = option(
        86400.0, cli="--job-ttl", gt=0,
        help="seconds a finished /v1/videos job and its file are kept (default: 86400 = one day)",
    )  # fmt: skip
    log_progress_interval: float = option(
        5.0, cli="--log-progress-interval", gt=0,
        help="seconds between the progress lines (step, s/step) of a long request in the log (default: 5)",
    )  # fmt: skip
    #: For the image URLs of response_format="url"; unset, the request's own scheme and Host header.
    public_url: str | None = option(
        None, cli="--public-url", convert=check_public_url, metavar="URL",
        help="the server's address as clients reach it (https://host[:port][/prefix]), for "
        "response_format='url' image links (default: the request's own scheme and Host header)",
    )  # fmt: skip
    #: `server/replicas.py`.
    dp_size: int = option(
        1, cli="--dp-size", min=1, metavar="N",
        help="data-parallel replicas: N engine processes, each with its own copy of the model, behind this "
        "server, which sends each request to the least-loaded ready one; a replica that dies is "
        "restarted while the others serve. On accelerators replica i uses device index i x (devices per "
        "replica); on the CPU the replicas share the CPU cores (default: 1)",
    )  # fmt: skip
    #: `connections.py`: what a client may hold open before its request has arrived.
    header_timeout: float = option(
        10.0, cli="--header-timeout", gt=0,
        help="seconds a client has to send a request's headers, from connecting (or from the previous answer "
        "on a kept-alive connection); then the connection is closed (default: 10)",
    )  # fmt: skip
    #: middleware.BodySizeLimitMiddleware.
    body_timeout: float = option(
        8.0, cli="--body-timeout", gt=0,
        help="seconds a request body may stall (nothing received) before the request is answered 408 "
        "(default: 8)",
    )  # fmt: skip
    #: uvicorn's `timeout_keep_alive`.
    keep_alive_timeout: float = option(
        5.0, cli="--keep-alive-timeout", gt=0,
        help="seconds an idle kept-alive connection stays open for the client's next request (default: 5)",
    )  # fmt: skip
    max_connections: int = option(
        1024, cli="--max-connections", min=1,
        help="open connections in all; a newcomer past it closes the oldest idle one, or is answered 503 "
        "when none is idle. The open-file limit is raised to fit (default: 1024)",
    )  # fmt: skip
    #: By the address the connection comes from: behind a proxy every client has the proxy's.
    max_connections_per_client: int = option(
        128, cli="--max-connections-per-client", min=0,
        help="open connections from one client address; more are answered 503 at once. Behind a reverse "
        "proxy all clients share its address: raise it, or 0 for no limit (default: 128)",
    )  # fmt: skip
    #: `webui_routes.py`.
    webui: bool = option(
        True,
        cli="--webui",
        help="serve the web playground (generate, edit, video, gallery) at / (default: on)",
    )

    def __post_init__(self) -> None:
        if self.admin_api_key is not None and self.admin_api_key.strip() in self.api_keys:
            raise UserError("--admin-api-key must differ from every --api-key key")

    @property
    def api_keys(self) -> list[str]:
        """The clients' keys of --api-key (comma-separated), stripped; empty without one."""
        from diffserve.server.access import parse_api_keys

        return [] if self.api_key is None else parse_api_keys(self.api_key)

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
        from diffserve.image_inputs import ImageInputLimits

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
        """For /server_info: everything but the keys themselves (how many client keys there are)."""
        out = asdict(self)
        keys = len(self.api_keys)
        out["api_key"] = None if not keys else "set" if keys == 1 else f"set ({keys} keys)"
        out["admin_api_key"] = "set" if self.admin_api_key else None
        return out
