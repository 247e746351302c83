"""Per-step DiT time and weight bytes of weight-only quantization (`--quantization int8|fp8`) against
full precision, on the CPU, side by side in one process.

The DiT is FLUX-architecture at FLUX.1's width (24 heads x 128 = 3072, joint width 4096, pooled 768,
guidance embedding) with 1 double- and 1 single-stream block (~0.55B parameters): every matmul has
FLUX.1's shape, there are just fewer blocks. It is built with random weights, fused as diffserve's loader
leaves it (`fuse_for_inference`), copied twice and quantized by `loader/quantize.py::quantize_dit`, and
bound to the CPU platform (so each `QuantizedLinear` takes its CPU path: the int8 kernel
`aten._weight_int8pack_mm` for bf16 inputs of few rows, dequantize-and-matmul otherwise). One
measurement is one DiT forward (`torch.inference_mode`) of `--batch` rows of `--image-tokens` image
tokens and `--text-tokens` text tokens, at each `--dtypes` compute dtype (the model loaded in it).

After one untimed warm-up forward per variant, each round runs every variant once in a rotated order, so
drift of the shared machine reaches all alike; a step is the median over rounds, a ratio the median over
rounds of (variant / full precision in the same round) with its range. Weight bytes are the DiT's
parameters + buffers. The output's relative L2 error against full precision is printed as a check that
the quantized models compute the same function.

    .venv/bin/python benchmarks/bench_quantization.py                       # fp32 and bf16, batch 1 and 2
    .venv/bin/python benchmarks/bench_quantization.py --dtypes float32 --batches 1 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

import harness
from diffserve.families.flux.tiny import flux_dit_inputs
from diffserve.layers.custom_op import dispatch_custom_ops
from diffserve.loader.quantize import quantize_dit, tensor_bytes
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.platforms import CpuPlatform
from diffserve.registry import DIT_FACTS

DIT_CONFIG = {
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
VARIANTS = ("full", "int8", "fp8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


def build_variants(dtype: torch.dtype) -> dict[str, nn.Module]:
    """The full-precision DiT in `dtype` (fused) and its int8 and fp8 copies, bound to the CPU."""
    torch.manual_seed(0)
    full = FluxTransformer2DModel.from_config(DIT_CONFIG).to(dtype).eval().requires_grad_(False)
    full.fuse_for_inference()
    models = {"full": full}
    for mode in ("int8", "fp8"):
        model = copy.deepcopy(full)
        quantize_dit(model, mode, "FluxTransformer2DModel", DIT_FACTS)
        models[mode] = model
    platform = CpuPlatform()
    for model in models.values():
        dispatch_custom_ops(model, platform)
    return models


def dit_inputs(
    batch: int, image_tokens: int, text_tokens: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    side = int(image_tokens**0.5)
    if side * side != image_tokens:
        raise SystemExit(f"--image-tokens must be a square number, got {image_tokens}")
    inputs = flux_dit_inputs(
        side, side, text_tokens, [0.5] * batch, in_channels=64, context_dim=4096, pooled_dim=768
    )
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def time_variants(
    models: dict[str, nn.Module], inputs: dict[str, torch.Tensor], rounds: int
) -> tuple[dict[str, Timings], dict[str, float]]:
    """Rotated rounds of one forward per variant; also each variant's relative L2 error against full."""
    outputs = {}
    with torch.inference_mode():
        for name, model in models.items():  # warm-up, untimed
            outputs[name] = model(**inputs).float()
        timings = {name: Timings() for name in models}
        for round_ in range(rounds):
            shift = round_ % len(VARIANTS)
            this_round = {}
            for name in [*VARIANTS[shift:], *VARIANTS[:shift]]:
                start = time.perf_counter()
                models[name](**inputs)
                this_round[name] = time.perf_counter() - start
            for name, seconds in this_round.items():
                timings[name].seconds.append(seconds)
                timings[name].ratios.append(seconds / this_round["full"])
            print(f"    round {round_ + 1}/{rounds}: {this_round}", file=sys.stderr, flush=True)
    reference = outputs["full"]
    errors = {name: ((out - reference).norm() / reference.norm()).item() for name, out in outputs.items()}
    return timings, errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes, comma-separated")
    p.add_argument("--batches", default="1,2", help="batch sizes, comma-separated")
    p.add_argument("--image-tokens", type=int, default=256, help="a square number (256: 256x256 pixels)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = harness.machine_info()
    print(
        f"# {info['cpu']}, {info['cores']} cores, {torch.get_num_threads()} torch threads, torch {info['torch']}"
    )
    print(
        f"# FLUX-architecture DiT, 24 heads x 128, 1 double + 1 single block; {args.image_tokens} image + "
        f"{args.text_tokens} text tokens; median of {args.rounds} rotated rounds\n"
    )
    print(
        "| dtype | batch | variant | weights MiB | bytes vs full | s/step | step vs full (range) | rel. error |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        print(f"  building the {dtype_name} models ...", file=sys.stderr, flush=True)
        models = build_variants(dtype)
        weight_bytes = {name: tensor_bytes(model) for name, model in models.items()}
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"  {dtype_name}, batch {batch}:", file=sys.stderr, flush=True)
            inputs = dit_inputs(batch, args.image_tokens, args.text_tokens, dtype)
            timings, errors = time_variants(models, inputs, args.rounds)
            for name in VARIANTS:
                t = timings[name]
                ratio = statistics.median(t.ratios)
                print(
                    f"| {dtype_name} | {batch} | {name} | {weight_bytes[name] / 2**20:.0f} | "
                    f"{weight_bytes[name] / weight_bytes['full']:.1%} | {statistics.median(t.seconds):.3f} | "
                    f"{ratio:.2f}x ({min(t.ratios):.2f}-{max(t.ratios):.2f}) | {errors[name]:.2e} |",
                    flush=True,
                )
        del models
        gc.collect()


if __name__ == "__main__":
    main()
