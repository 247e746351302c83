"""Flags shared by every command that loads a model (`generate`, `serve`, `calibrate-cache`), and the
EngineArgs they make. The flags are `EngineArgs`' declarations (`configs/engine_args.py`), and
`--log-level` is `ServerArgs.log_level`'s."""

from __future__ import annotations

import argparse

from diffserve.cli.lora_flags import lora_engine_fields
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.option import add_options, namespace_values
from diffserve.server.args import ServerArgs


def add_engine_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """`--log-level` and the EngineArgs flags declared for `command` ("generate", "serve", ...)."""
    add_options(parser, ServerArgs, command, only=("log_level",))
    add_options(parser, EngineArgs, command)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the flags the command has (the others keep their defaults), each checked against
    its declaration (UserError naming the flag); no --model-path means the shipped demo model (logged)."""
    from diffserve.configs.demo_model import model_path_or_demo

    values = lora_engine_fields(args, namespace_values(EngineArgs, args))
    values["model_path"] = model_path_or_demo(args.model_path)
    engine_args = EngineArgs(**values)  # type: ignore[arg-type]
    engine_args.parallel_config()  # degrees that do not multiply to --num-gpus fail before any model load
    return engine_args
