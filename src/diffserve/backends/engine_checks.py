"""The engine settings a backend accepts: `--backend` itself, and the flags the diffusers backend cannot honour
(each refused by name at startup, never ignored)."""

from __future__ import annotations

from diffserve.backends import BACKENDS
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.quality import EXACT, check_default_quality
from diffserve.errors import UserError


def unsupported_flags(args: EngineArgs) -> list[str]:
    """The flags set in `args` that `--backend diffusers` does not implement."""
    flags = {
        "--compile": args.compile,
        "--enable-cuda-graph": args.enable_cuda_graph,
        "--quantization": args.quantization is not None,
        "--transformer-weights": args.transformer_weights is not None,
        "--text-encoder-dtype": args.text_encoder_dtype is not None,
        "--attention-backend": args.attention_backend is not None,
        "--num-gpus": args.num_gpus != 1,
        "--lora": bool(args.loras),
        "--lora-dir": args.lora_dir is not None,
        "--text-encoder-cpu-offload": args.text_encoder_cpu_offload,
        "--image-encoder-cpu-offload": args.image_encoder_cpu_offload,
        "--vae-cpu-offload": args.vae_cpu_offload,
        "--vae-tiling": args.vae_tiling,
        "--dit-cpu-offload": args.dit_cpu_offload,
        "--dit-layerwise-offload": args.dit_layerwise_offload,
        "--offload": args.offload != "none",
        "--max-memory": args.max_memory is not None,
        "--cache-default": args.cache_default is not None,
    }
    unsupported = [flag for flag, is_set in flags.items() if is_set]
    try:
        if check_default_quality(args.default_quality) != EXACT:
            unsupported.append("--default-quality")
    except ValueError:
        unsupported.append("--default-quality")
    return unsupported


def check_backend_args(args: EngineArgs) -> None:
    """UserError for an unknown backend, or for flags the chosen backend cannot honour."""
    if args.backend not in BACKENDS:
        raise UserError(f"unknown backend {args.backend!r}; choose one of: {', '.join(BACKENDS)}")
    if args.backend == "native":
        return
    unsupported = unsupported_flags(args)
    if unsupported:
        raise UserError(
            f"{', '.join(unsupported)}: not available with --backend diffusers, which runs the Diffusers "
            "pipeline as it is; drop these flags, or serve a ported pipeline with the native backend"
        )
