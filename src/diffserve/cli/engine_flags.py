"""Flags shared by every command that loads a model (`generate`, `serve`), and the EngineArgs they make."""

from __future__ import annotations

import argparse
from typing import Literal

from diffserve.backends import BACKENDS
from diffserve.cli.lora_flags import add_lora_flags, lora_engine_fields
from diffserve.cli.memory_flags import add_memory_flags, memory_engine_fields
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.quality import DEFAULT_QUALITY_CHOICES, EXACT, canonical_tier
from diffserve.errors import UserError
from diffserve.logging_setup import LEVELS


def add_engine_flags(p: argparse.ArgumentParser, lora: Literal["serve", "generate"] | None = None) -> None:
    """`lora`: the command's LoRA flags (cli/lora_flags.py); None for a command without them."""
    add = p.add_argument
    add("--log-level", default="info", choices=LEVELS, metavar="LEVEL",
        help=f"log verbosity: {', '.join(LEVELS)}; debug also prints the traceback of an error (default: info)")  # fmt: skip
    add("--model-path", default=None,
        help="Diffusers model folder (with model_index.json) or Hugging Face repo id such as "
        "black-forest-labs/FLUX.1-dev (from the HF cache, else downloaded); "
        "default: the small demo model shipped with diffserve")  # fmt: skip
    add("--backend", default="native", choices=BACKENDS,
        help="native: diffserve's own pipelines; diffusers: run the folder's Diffusers pipeline class through "
        "diffusers (pipelines diffserve has not ported; one request at a time, exact quality only; needs "
        "pip install 'diffserve[diffusers]') (default: native)")  # fmt: skip
    add("--revision", default=None,
        help="with a Hugging Face repo id: branch, tag or commit hash (default: main)")  # fmt: skip
    add("--device", default=None, help="platform: cpu, cuda, rocm, musa, xpu, npu, mps (default: detect)")
    add("--dtype", default=None, help="float32, bfloat16 or float16 (default: the platform's)")
    add("--text-encoder-dtype", default=None, help="dtype of the text encoders (default: --dtype)")
    add("--attention-backend", default=None, help="sdpa, flash_attn or sage_attn (default: sdpa)")
    add("--compile", action="store_true",
        help="torch.compile the DiT's repeated blocks (dynamic shapes), compiled by a start-up warm-up")  # fmt: skip
    add("--warmup-resolutions", nargs="+", default=[], metavar="WxH", type=parse_resolution,
        help="sizes generated once at startup, e.g. 1024x1024 768x1344 (default: none)")  # fmt: skip
    add("--tune-allocator", action="store_true",
        help="CPU (glibc): keep activation buffers mapped between steps (measure: host-dependent)")  # fmt: skip
    add("--max-inference-steps", type=int, default=EngineArgs.max_inference_steps, metavar="N",
        help=f"most denoising steps a request may ask for (default: {EngineArgs.max_inference_steps})")  # fmt: skip
    add("--default-quality", default=EXACT, choices=DEFAULT_QUALITY_CHOICES,
        help="what quality='auto' means: high (exact; also hd, lossless) or a faster tier: medium, low, draft "
        "(default: high)")  # fmt: skip
    add_parallel_flags(p)
    add_memory_flags(p)
    if lora is not None:
        add_lora_flags(p, one_off=lora == "generate")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """SGLang Diffusion's multi-device flags (docs/parallelism.md)."""
    g = p.add_argument_group("multi-device", "num-gpus = cfg (2 with --enable-cfg-parallel) x tp x ulysses x "
        "ring; on the CPU each 'gpu' is one rank process over gloo")  # fmt: skip
    add = g.add_argument
    add(
        "--num-gpus",
        type=int,
        default=1,
        metavar="N",
        help="ranks (devices) one request runs on (default: 1)",
    )
    add("--ulysses-degree", type=int, default=None, metavar="N",
        help="Ulysses sequence parallel degree (default: what --num-gpus leaves: N / (cfg x tp x ring))")  # fmt: skip
    add("--ring-degree", type=int, default=1, metavar="N", help="Ring attention degree (default: 1)")
    add("--enable-cfg-parallel", action="store_true",
        help="run the positive and negative CFG branches on different ranks (cfg degree 2)")  # fmt: skip
    add("--tp-size", type=int, default=1, metavar="N", help="tensor parallel degree (default: 1)")
    add("--nnodes", type=int, default=1, metavar="N", help="machines the ranks span (default: 1)")
    add(
        "--node-rank",
        type=int,
        default=0,
        metavar="K",
        help="this machine's index in [0, nnodes) (default: 0)",
    )
    add("--dist-init-addr", default=None, metavar="HOST:PORT",
        help="node 0's rendezvous address for multi-node runs (default: a free loopback port, or torchrun's)")  # fmt: skip
    add("--dist-timeout", type=int, default=EngineArgs.dist_timeout, metavar="SECONDS",
        help=f"most seconds a rank waits for the others in one exchange (default: {EngineArgs.dist_timeout})")  # fmt: skip


def parse_resolution(text: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' (OpenAI's size order) -> (height, width)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 1024x768, got {text!r}")
    width, height = (int(part) for part in parts)
    return height, width


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the shared flags; no --model-path means the shipped demo model (logged)."""
    from diffserve.configs.demo_model import model_path_or_demo

    if args.max_inference_steps < 1:
        raise UserError(f"--max-inference-steps must be >= 1, got {args.max_inference_steps}")
    if args.revision is not None and not args.revision.strip():
        raise UserError("--revision must not be empty (omit it for the repo's main branch)")
    if args.dist_timeout < 1:
        raise UserError(f"--dist-timeout must be >= 1 second, got {args.dist_timeout}")
    engine_args = EngineArgs(
        model_path=model_path_or_demo(args.model_path),
        revision=args.revision,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        text_encoder_dtype=args.text_encoder_dtype,
        attention_backend=args.attention_backend,
        output_path=args.output_path,
        compile=args.compile,
        warmup_resolutions=list(args.warmup_resolutions),
        default_quality=canonical_tier(args.default_quality),  # /server_info shows "high", not "lossless"
        tune_allocator=args.tune_allocator,
        max_inference_steps=args.max_inference_steps,
        num_gpus=args.num_gpus,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        enable_cfg_parallel=args.enable_cfg_parallel,
        tp_size=args.tp_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        dist_timeout=args.dist_timeout,
        **lora_engine_fields(args),  # type: ignore[arg-type]
        **memory_engine_fields(args),  # type: ignore[arg-type]
    )
    engine_args.parallel_config()  # degrees that do not multiply to --num-gpus fail before any model load
    return engine_args
