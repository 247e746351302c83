"""Memory flags of `serve` and `generate` (docs/memory.md): weight-only quantization, a single-file DiT
checkpoint, component and layerwise offload, the automatic plan and the host-memory cap; and the
EngineArgs fields they make. Nothing here imports torch."""

from __future__ import annotations

import argparse

from diffserve.cli.lora_flags import parse_size
from diffserve.configs.memory_options import (
    OFFLOAD_MODES,
    QUANTIZATION_MODES,
    check_offload,
    check_quantization,
    check_transformer_weights,
)


def add_memory_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory", "quantization, single-file weights and offload (docs/memory.md)")
    add = g.add_argument
    add("--quantization", default=None, choices=QUANTIZATION_MODES,
        help="weight-only quantization of the DiT's Linears at load, per output channel (norms, embeddings "
        "and the final layer stay in full precision); default: none")  # fmt: skip
    add("--transformer-weights", default=None, metavar="PATH",
        help="a single-file DiT checkpoint replacing the folder's DiT weights: .safetensors (original "
        "BFL/ComfyUI or Diffusers key names, FP8 included) or .gguf (Q8_0, Q4_K, F16, ...)")  # fmt: skip
    add("--text-encoder-cpu-offload", action="store_true",
        help="keep the text encoders in host memory; they move to the device to encode")  # fmt: skip
    add("--image-encoder-cpu-offload", action="store_true",
        help="keep the image encoder in host memory; it moves to the device to encode")  # fmt: skip
    add("--vae-cpu-offload", action="store_true",
        help="keep the VAE in host memory; it moves to the device to encode or decode")  # fmt: skip
    add("--vae-tiling", action="store_true",
        help="decode (and encode) in overlapping tiles, as Diffusers' enable_tiling: less memory, slightly "
        "different pixels; without it a decode is tiled only when it would not fit in memory")  # fmt: skip
    add("--dit-cpu-offload", action="store_true",
        help="keep the DiT in host memory; it moves to the device while requests denoise")  # fmt: skip
    add("--dit-layerwise-offload", action="store_true",
        help="keep the DiT's blocks in host memory and stream them to the device one at a time, the next "
        "block's copy overlapping the current block's compute")  # fmt: skip
    add("--offload", default="none", choices=OFFLOAD_MODES,
        help="auto: keep resident what fits in the device's free memory and offload the rest, least costly "
        "first (the plan is logged); none: only the flags above (default)")  # fmt: skip
    add("--max-memory", default=None, metavar="SIZE",
        help="host memory the model's weights may take (e.g. 8GiB); past it the DiT's weights stay in their "
        "files and stream per block (slower, logged). Default: no cap")  # fmt: skip


def memory_engine_fields(args: argparse.Namespace) -> dict[str, object]:
    """The EngineArgs memory fields from the flags; {} for a command without them."""
    if "quantization" not in vars(args):
        return {}
    return {
        "quantization": check_quantization(args.quantization),
        "transformer_weights": check_transformer_weights(args.transformer_weights),
        "text_encoder_cpu_offload": args.text_encoder_cpu_offload,
        "image_encoder_cpu_offload": args.image_encoder_cpu_offload,
        "vae_cpu_offload": args.vae_cpu_offload,
        "vae_tiling": args.vae_tiling,
        "dit_cpu_offload": args.dit_cpu_offload,
        "dit_layerwise_offload": args.dit_layerwise_offload,
        "offload": check_offload(args.offload),
        "max_memory": None if args.max_memory is None else parse_size(args.max_memory, "--max-memory"),
    }
