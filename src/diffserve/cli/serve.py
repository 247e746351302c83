"""`diffserve serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over an engine process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from

logger = logging.getLogger("diffserve")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Diffusers-format model over HTTP (OpenAI schema): /v1/images/generations and "
        "/v1/images/edits, /v1/videos jobs, /v1/loras, /v1/models, /health, /health_generate, /server_info, "
        "/metrics.",
    )
    add_engine_flags(p, lora="serve")
    add = p.add_argument
    add("--served-model-name", dest="served_model_names", nargs="+", default=[], metavar="NAME",
        help="name(s) clients pass as 'model'; /v1/models lists the first (default: the model path)")  # fmt: skip
    add("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    add("--port", type=int, default=30000, help="port to listen on (default: 30000)")
    add("--api-key", default=os.environ.get("DIFFSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' but on /health* and /metrics (default: $DIFFSERVE_API_KEY)")  # fmt: skip
    add("--max-queue-size", type=int, default=64,
        help="requests allowed to wait (not counting running ones, nor those free running slots take "
             "next); more get 429 (default: 64)")  # fmt: skip
    add("--max-running-requests", type=int, default=8,
        help="requests running at once, sharing denoising steps as one DiT batch per shape (default: 8)")  # fmt: skip
    add("--max-batch-tokens", type=int, default=None,
        help="cap on running latent tokens x CFG branches x outputs (default: 65536; 16384 on CPU)")  # fmt: skip
    add("--mem-fraction", type=float, default=0.9,
        help="share of the free memory after warm-up running requests may use; 413 if one never fits (default: 0.9)")  # fmt: skip
    add("--max-body-bytes", type=int, default=1 << 20,
        help="largest request body, beyond /v1/images/edits' images; larger: 413 (default: 1048576)")  # fmt: skip
    add("--allow-url-images", action="store_true",
        help="let /v1/images/edits fetch input images from public http(s) URLs (default: off)")  # fmt: skip
    add("--max-image-bytes", type=int, default=20 << 20,
        help="largest encoded input image; larger ones get 413 (default: 20971520 = 20 MiB)")  # fmt: skip
    add("--max-image-pixels", type=int, default=4096 * 4096,
        help="largest input image in pixels, checked before decoding; larger: 413 (default: 4096x4096)")  # fmt: skip
    add("--dp-size", type=int, default=1, metavar="N",
        help="data-parallel replicas: N engine processes, each with its own copy of the model, behind this "
             "server, which sends each request to the least-loaded ready one; a replica that dies is "
             "restarted while the others serve. On accelerators replica i uses device index i x (devices per "
             "replica); on the CPU the replicas share the CPU cores (default: 1)")  # fmt: skip
    add("--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM or Ctrl-C, seconds requests in flight and /v1/videos jobs get to finish before they "
             "are cancelled; a second signal stops at once (default: 30)")  # fmt: skip
    add("--warmup", action=argparse.BooleanOptionalAction, default=True,
        help="run a 1-step generation before reporting ready (default: on)")  # fmt: skip
    add("--output-path", default="outputs",
        help="directory for response_format='url' images and /v1/videos jobs (default: outputs/)")  # fmt: skip
    add("--job-ttl", type=float, default=86400.0,
        help="seconds a finished /v1/videos job and its file are kept (default: 86400 = one day)")  # fmt: skip
    add("--url-fetch-timeout", type=float, default=10.0,
        help="with --allow-url-images: seconds one input-image download may take in all; then 400 (default: 10)")  # fmt: skip
    add("--log-progress-interval", type=float, default=5.0,
        help="seconds between the progress lines (step, s/step) of a long request in the log (default: 5)")  # fmt: skip
    add("--public-url", default=None, metavar="URL",
        help="the server's address as clients reach it (https://host[:port][/prefix]), for response_format='url' "
        "image links (default: the request's own scheme and Host header)")  # fmt: skip
    add("--webui", action=argparse.BooleanOptionalAction, default=True,
        help="serve the web playground (generate, edit, video, gallery) at / (default: on)")  # fmt: skip
    p.set_defaults(handler=run)


# Flag -> (whether a value is valid, what a valid value is); the server refuses to start otherwise.
_VALID: dict[str, tuple[Callable[[Any], bool], str]] = {
    "port": (lambda v: 0 <= v <= 65535, "in 0..65535"),
    "max_queue_size": (lambda v: v >= 0, ">= 0"),
    "max_running_requests": (lambda v: v >= 1, ">= 1"),
    "max_batch_tokens": (lambda v: v is None or v >= 1, ">= 1"),
    "mem_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "max_body_bytes": (lambda v: v >= 1, ">= 1"),
    "max_image_bytes": (lambda v: v >= 1, ">= 1"),
    "max_image_pixels": (lambda v: v >= 1, ">= 1"),
    "job_ttl": (lambda v: v > 0, "> 0 seconds"),
    "url_fetch_timeout": (lambda v: v > 0, "> 0 seconds"),
    "log_progress_interval": (lambda v: v > 0, "> 0 seconds"),
    "shutdown_timeout": (lambda v: v >= 0, ">= 0"),
    "dp_size": (lambda v: v >= 1, ">= 1"),
}


def _checked_public_url(url: str) -> str:
    """`--public-url`: an absolute http(s) URL with a host and no query or fragment, without a trailing /."""
    from urllib.parse import urlsplit

    from diffserve.errors import UserError

    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise UserError(f"--public-url must be an http(s) URL such as https://img.example.com, got {url!r}")
    return parts.geturl().rstrip("/")


def run(args: argparse.Namespace) -> int:
    from diffserve.errors import UserError
    from diffserve.loader.model_index import read_model_index
    from diffserve.server.args import ServerArgs
    from diffserve.server.runner import serve

    for name, (valid, rule) in _VALID.items():
        if not valid(getattr(args, name)):
            raise UserError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key must not be empty")
    if args.public_url is not None:
        args.public_url = _checked_public_url(args.public_url)
    engine_args = engine_args_from(args)
    if args.dp_size > 1 and (engine_args.nnodes > 1 or engine_args.dist_init_addr is not None):
        raise UserError(
            "--dp-size > 1 cannot be combined with --nnodes or --dist-init-addr (every replica would meet "
            "at the same rendezvous address); run one server per replica behind a load balancer instead"
        )
    for name in ("max_running_requests", "max_batch_tokens", "mem_fraction"):
        setattr(engine_args, name, getattr(args, name))
    # A wrong path or repo id fails here, before the server starts listening.
    read_model_index(engine_args.model_path, engine_args.revision)
    # Every flag named as a ServerArgs field is that field.
    server_fields = {field.name for field in dataclasses.fields(ServerArgs)} & set(vars(args))
    return serve(ServerArgs(engine_args, **{name: getattr(args, name) for name in server_fields}))
