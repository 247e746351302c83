"""`diffserve serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over an engine process."""

from __future__ import annotations

import argparse
import logging

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.configs.option import add_options, namespace_values
from diffserve.server.args import ServerArgs, check_public_url

logger = logging.getLogger("diffserve")

#: `--public-url`'s check (`ServerArgs.public_url` declares it).
_checked_public_url = check_public_url


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Diffusers-format model over HTTP (OpenAI schema): /v1/images/generations and "
        "/v1/images/edits, /v1/videos jobs, /v1/loras, /v1/models, /health, /health_generate, /server_info, "
        "/metrics.",
    )
    add_engine_flags(p, "serve")
    add_options(p, ServerArgs, "serve", skip=("log_level",))  # added with the engine's flags
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from diffserve.errors import UserError
    from diffserve.loader.model_index import read_model_index
    from diffserve.server.runner import serve

    server_values = namespace_values(ServerArgs, args)  # bounds: UserError naming the flag
    engine_args = engine_args_from(args)
    if args.dp_size > 1 and (engine_args.nnodes > 1 or engine_args.dist_init_addr is not None):
        raise UserError(
            "--dp-size > 1 cannot be combined with --nnodes or --dist-init-addr (every replica would meet "
            "at the same rendezvous address); run one server per replica behind a load balancer instead"
        )
    # A wrong path or repo id fails here, before the server starts listening.
    read_model_index(engine_args.model_path, engine_args.revision)
    return serve(ServerArgs(engine_args, **server_values))  # type: ignore[arg-type]
