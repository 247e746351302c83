"""`diffserve serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over an engine process."""

from __future__ import annotations

import argparse
import logging
import os

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.logging_setup import LEVELS

logger = logging.getLogger("diffserve")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Diffusers-format model over HTTP: POST /v1/images/generations and "
        "POST /v1/images/edits (OpenAI schema) for image models, the /v1/videos job API for video models, "
        "GET /v1/models, /health, /health_generate, /server_info, /metrics. The model runs in its own "
        "engine process; the HTTP front end never blocks on it.",
    )
    add_engine_flags(p)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="model name(s) clients pass as 'model'; the first is what /v1/models lists "
        "(default: the model path; its folder name is always accepted too)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)"
    )
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default: 30000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("DIFFSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, /health_generate and "
        "/metrics (default: $DIFFSERVE_API_KEY; unset: no auth). Image URLs carry their own token",
    )
    p.add_argument(
        "--max-queue-size",
        type=int,
        default=64,
        help="requests allowed to wait for the engine (not counting the running ones); more get "
        "429 (default: 64)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=8,
        help="requests the engine runs at once, sharing denoising steps as one DiT batch per shape "
        "(step-level batching); 1: one request at a time (default: 8)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="cap on the running requests' latent tokens x CFG branches x outputs (a 1024x1024 "
        "FLUX image is 4096 tokens); requests beyond it wait (default: 65536 on accelerators, "
        "16384 on CPU)",
    )
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=0.9,
        help="share of the free memory measured after warm-up that running requests may use; a "
        "request is admitted only while the estimated total fits, and one that cannot fit even "
        "alone gets 413 (default: 0.9)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body; larger ones get 413 (default: 1048576). /v1/images/edits "
        "allows 17 images at --max-image-bytes as base64 on top of it",
    )
    p.add_argument(
        "--allow-url-images",
        action="store_true",
        help="let /v1/images/edits fetch input images from http(s) URLs on public hosts (default: "
        "off; uploads and base64 data URLs only, no outbound requests)",
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=20 << 20,
        help="largest input image (encoded: upload, decoded data URL or download); larger ones get "
        "413 (default: 20971520 = 20 MiB). The edits route's body limit follows from it",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=4096 * 4096,
        help="largest input image in pixels (width * height, checked before decoding); larger ones "
        "get 413 (default: 16777216 = 4096x4096)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled (default: 30)",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a 1-step generation before reporting ready (default: on)",
    )
    p.add_argument(
        "--output-path",
        default="outputs",
        help="directory for images returned as response_format='url', and for /v1/videos jobs "
        "(videos/<id>.mp4 and video_jobs.sqlite3) (default: outputs/)",
    )
    p.add_argument(
        "--job-ttl",
        type=float,
        default=86400.0,
        help="seconds a finished /v1/videos job and its MP4 are kept after it finished; then both "
        "are deleted (default: 86400 = one day)",
    )
    p.add_argument("--log-level", default="info", choices=LEVELS)
    p.set_defaults(handler=run)


def _check_args(args: argparse.Namespace) -> None:
    from diffserve.errors import UserError

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue_size < 0:
        raise UserError(f"--max-queue-size must be >= 0, got {args.max_queue_size}")
    if args.max_running_requests < 1:
        raise UserError(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise UserError(f"--max-batch-tokens must be >= 1, got {args.max_batch_tokens}")
    if not 0 < args.mem_fraction <= 1:
        raise UserError(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    if args.max_body_bytes < 1:
        raise UserError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.max_image_bytes < 1:
        raise UserError(f"--max-image-bytes must be >= 1, got {args.max_image_bytes}")
    if args.max_image_pixels < 1:
        raise UserError(f"--max-image-pixels must be >= 1, got {args.max_image_pixels}")
    if not args.job_ttl > 0:
        raise UserError(f"--job-ttl must be > 0 seconds, got {args.job_ttl}")
    if args.shutdown_timeout < 0:
        raise UserError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key must not be empty")


def run(args: argparse.Namespace) -> int:
    from diffserve.loader.model_index import read_model_index
    from diffserve.server.args import ServerArgs
    from diffserve.server.runner import serve

    _check_args(args)
    engine_args = engine_args_from(args)
    engine_args.max_running_requests = args.max_running_requests
    engine_args.max_batch_tokens = args.max_batch_tokens
    engine_args.mem_fraction = args.mem_fraction
    read_model_index(engine_args.model_path)  # a wrong path fails here, before the server starts listening
    server_args = ServerArgs(
        engine_args=engine_args,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=list(args.served_model_name),
        max_queue_size=args.max_queue_size,
        max_body_bytes=args.max_body_bytes,
        allow_url_images=args.allow_url_images,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        job_ttl=args.job_ttl,
        shutdown_timeout=args.shutdown_timeout,
        warmup=args.warmup,
        log_level=args.log_level,
    )
    return serve(server_args)
