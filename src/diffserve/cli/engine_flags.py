"""Flags shared by every command that loads a model (`generate`, `serve`), and the EngineArgs they make."""

from __future__ import annotations

import argparse

from diffserve.configs.engine_args import EngineArgs


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-path",
        default=None,
        help="Diffusers model folder (with model_index.json); default: the small demo model shipped with diffserve",
    )
    p.add_argument("--device", default=None, help="platform: cpu, cuda, rocm, musa, xpu, npu, mps (default: detect)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the platform's)")
    p.add_argument("--text-encoder-dtype", default=None, help="dtype of the text encoders (default: --dtype)")
    p.add_argument("--attention-backend", default=None, help="sdpa, flash_attn or sage_attn (default: sdpa)")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the shared flags; no --model-path means the shipped demo model (logged)."""
    from diffserve.configs.demo_model import model_path_or_demo

    return EngineArgs(
        model_path=model_path_or_demo(args.model_path),
        device=args.device,
        dtype=args.dtype,
        text_encoder_dtype=args.text_encoder_dtype,
        attention_backend=args.attention_backend,
        output_path=args.output_path,
    )
