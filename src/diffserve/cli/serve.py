"""`diffserve serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over an engine process; with
`--ray`, the same server and engines as a Ray Serve application (diffserve/deploy/), several models
(`--model-path` repeated) and replicas across a cluster."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.configs.option import add_options, namespace_values
from diffserve.deploy.cli_args import RayServeArgs
from diffserve.server.args import ServerArgs, check_public_url

logger = logging.getLogger("diffserve")

#: `--public-url`'s check (`ServerArgs.public_url` declares it).
_checked_public_url = check_public_url


class EveryModelPath(argparse._StoreAction):
    """`serve`'s `--model-path`: stored as every command stores it (the last one given), and each one
    given kept, in order, in `model_paths`: `--ray` serves several models."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        super().__call__(parser, namespace, values, option_string)
        namespace.model_paths = [*(getattr(namespace, "model_paths", None) or []), values]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Diffusers-format model over HTTP (OpenAI schema): /v1/images/generations and "
        "/v1/images/edits, /v1/videos jobs, /v1/loras, /v1/models, /health, /health_generate, /server_info, "
        "/metrics. With --ray, on Ray Serve: several models and replicas across a cluster at one address.",
    )
    add_engine_flags(p, "serve")
    next(action for action in p._actions if action.dest == "model_path").__class__ = EveryModelPath
    add_options(p, ServerArgs, "serve", skip=("log_level",))  # added with the engine's flags
    add_options(p, RayServeArgs, "serve")
    p.set_defaults(handler=run)


def model_paths_of(args: argparse.Namespace) -> Sequence[str]:
    """Every `--model-path` given, in order (none: the demo model's, as `engine_args_from` picks it)."""
    return getattr(args, "model_paths", None) or []


def run(args: argparse.Namespace) -> int:
    from diffserve.errors import UserError
    from diffserve.loader.model_index import read_model_index
    from diffserve.server.runner import serve

    ray_args = RayServeArgs(**namespace_values(RayServeArgs, args))  # type: ignore[arg-type]
    ray_args.check()
    paths = model_paths_of(args)
    if len(paths) > 1 and not ray_args.ray:
        raise UserError("several --model-path need --ray (a server without it serves one model)")
    server_values = namespace_values(ServerArgs, args)  # bounds: UserError naming the flag
    engine_args = engine_args_from(args)
    if ray_args.ray:
        return run_on_ray(ray_args, ServerArgs(engine_args, **server_values), paths)  # type: ignore[arg-type]
    if args.dp_size > 1 and (engine_args.nnodes > 1 or engine_args.dist_init_addr is not None):
        raise UserError(
            "--dp-size > 1 cannot be combined with --nnodes or --dist-init-addr (every replica would meet "
            "at the same rendezvous address); run one server per replica behind a load balancer instead"
        )
    # A wrong path or repo id fails here, before the server starts listening.
    read_model_index(engine_args.model_path, engine_args.revision)
    return serve(ServerArgs(engine_args, **server_values))  # type: ignore[arg-type]


def run_on_ray(ray_args: RayServeArgs, server_args: ServerArgs, paths: Sequence[str]) -> int:
    """`serve --ray`: the builder's args from the flags, checked here (model folders included), then
    served on Ray Serve (deploy/run.py)."""
    from diffserve.deploy.cli_args import app_args_from, check_ray_installed
    from diffserve.errors import UserError
    from diffserve.loader.model_index import read_model_index

    check_ray_installed()
    engine = server_args.engine_args
    if server_args.dp_size > 1:
        raise UserError(
            "--dp-size is for one machine; with --ray give --num-replicas (Ray places the replicas)"
        )
    if engine.nnodes > 1 or engine.dist_init_addr is not None:
        raise UserError(
            "--nnodes and --dist-init-addr do not apply with --ray: a replica's ranks run on its node"
        )
    paths = list(paths) or [engine.model_path]
    for path in paths:
        read_model_index(path, engine.revision)
    app_args = app_args_from(ray_args, server_args, paths)
    from diffserve.deploy.run import serve_on_ray

    return serve_on_ray(app_args, ray_args.ray_address, server_args.host, server_args.port)
