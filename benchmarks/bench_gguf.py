"""Per-step DiT time and weight bytes of GGUF weights kept in their quantized blocks (`GGUFLinear`,
dequantized per layer as it runs) against the same file dequantized at load (diffserve before issue 31),
on the CPU, side by side in one process.

The DiT is FLUX-architecture with FLUX.1's head size, joint and pooled widths and `--heads` heads (12:
1536 wide) and 1 double- plus 1 single-stream block: every matmul has a FLUX-like shape, there are just
fewer blocks. Its random weights are written as a city96-layout GGUF file (FLUX.1's original names) per
`--qtypes` type, each loaded through `loader/single_file.py` in each `--dtypes` compute dtype: kept
quantized (the default; the loader leaves such a model unfused) and under `dequantized_at_load()`, then
fused as the loader fuses full-precision weights, and bound to the CPU platform. One measurement is one DiT
forward (`torch.inference_mode`) of `--batch` rows of `--image-tokens` image and `--text-tokens` text
tokens.

After one untimed warm-up per variant, each round runs every variant once in a rotated order (drift of
the shared machine reaches all alike); a step is the median over rounds, a ratio the median over rounds
of (variant / dequantized at load in the same round) with its range. A third arm, dequantized at load
but left unfused, separates the cost of running unfused from that of dequantizing. Weight bytes are the
DiT's parameters + buffers; the relative L2 difference of the outputs checks that all compute the same
function.

    .venv/bin/python benchmarks/bench_gguf.py                              # Q8_0 and Q4_K, fp32 and bf16
    .venv/bin/python benchmarks/bench_gguf.py --qtypes Q8_0 --dtypes float32 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import harness
from diffserve.families.flux.tiny import flux_dit_inputs
from diffserve.layers.custom_op import dispatch_custom_ops
from diffserve.loader.quantize import tensor_bytes
from diffserve.loader.single_file import dequantized_at_load, load_transformer_weights_file
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.platforms import CpuPlatform
from diffserve.registry import DIT_FACTS
from diffserve.testing.tiny_single_file import original_state_dict, write_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VARIANTS = ("dequantized at load", "dequantized, unfused", "kept quantized")


def dit_config(heads: int) -> dict:
    return {
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 128,
        "num_attention_heads": heads,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "guidance_embeds": True,
        "axes_dims_rope": [16, 56, 56],
    }


def write_file(config: dict, qtype: str, directory: Path) -> Path:
    torch.manual_seed(0)
    model = FluxTransformer2DModel.from_config(config)
    original = original_state_dict("FluxTransformer2DModel", model.state_dict())
    del model
    path = directory / f"flux-{qtype}.gguf"
    write_gguf(path, original, qtype, "flux")
    return path


def load(config: dict, path: Path, dtype: torch.dtype, variant: str) -> nn.Module:
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    if variant == "kept quantized":
        load_transformer_weights_file(
            model, path, "FluxTransformer2DModel", torch.device("cpu"), dtype, DIT_FACTS
        )
    else:
        with dequantized_at_load():
            load_transformer_weights_file(
                model, path, "FluxTransformer2DModel", torch.device("cpu"), dtype, DIT_FACTS
            )
        if variant == "dequantized at load":
            model.fuse_for_inference()  # as the loader does with full-precision weights
    model.eval().requires_grad_(False)
    dispatch_custom_ops(model, CpuPlatform())
    return model


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


def time_variants(models: dict[str, nn.Module], inputs: dict[str, torch.Tensor], rounds: int):
    outputs, seconds, ratios = {}, {n: [] for n in models}, {n: [] for n in models}
    with torch.inference_mode():
        for name, model in models.items():  # warm-up, untimed
            outputs[name] = model(**inputs).float()
        for round_ in range(rounds):
            shift = round_ % len(models)
            order = [*list(models)[shift:], *list(models)[:shift]]
            this_round = {}
            for name in order:
                start = time.perf_counter()
                models[name](**inputs)
                this_round[name] = time.perf_counter() - start
            for name, s in this_round.items():
                seconds[name].append(s)
                ratios[name].append(s / this_round[VARIANTS[0]])
            print(f"    round {round_ + 1}/{rounds}: {this_round}", file=sys.stderr, flush=True)
    reference = outputs[VARIANTS[0]]
    errors = {name: ((out - reference).norm() / reference.norm()).item() for name, out in outputs.items()}
    return seconds, ratios, errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--qtypes", default="Q8_0,Q4_K", help="GGUF types, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes, comma-separated")
    p.add_argument("--heads", type=int, default=12, help="attention heads of 128 (FLUX.1: 24)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--image-tokens", type=int, default=256, help="a square number (256: 256x256 pixels)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = harness.machine_info()
    config = dit_config(args.heads)
    print(
        f"# {info['cpu']}, {info['cores']} cores, {torch.get_num_threads()} torch threads, torch {info['torch']}"
    )
    print(
        f"# FLUX-architecture DiT, {args.heads} heads x 128, 1 double + 1 single block; batch {args.batch}, "
        f"{args.image_tokens} image + {args.text_tokens} text tokens; median of {args.rounds} alternating rounds\n"
    )
    print(
        "| type | dtype | variant | weights MiB | bytes vs fp32 | s/step | step vs dequantized at load (range) | rel. diff |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for qtype in args.qtypes.split(","):
            print(f"  writing the {qtype} file ...", file=sys.stderr, flush=True)
            path = write_file(config, qtype, Path(directory))
            for dtype_name in args.dtypes.split(","):
                dtype = DTYPES[dtype_name]
                models = {variant: load(config, path, dtype, variant) for variant in VARIANTS}
                fp32_bytes = tensor_bytes(models[VARIANTS[0]]) * 4 // dtype.itemsize
                inputs = dit_inputs(args.batch, args.image_tokens, args.text_tokens, dtype)
                seconds, ratios, errors = time_variants(models, inputs, args.rounds)
                for name in VARIANTS:
                    nbytes, r = tensor_bytes(models[name]), ratios[name]
                    row = {
                        "qtype": qtype, "dtype": dtype_name, "variant": name, "weights_mib": nbytes / 2**20,
                        "bytes_vs_fp32": nbytes / fp32_bytes, "s_per_step": statistics.median(seconds[name]),
                        "ratio": statistics.median(r), "ratio_min": min(r), "ratio_max": max(r),
                        "rel_diff": errors[name],
                    }  # fmt: skip
                    rows.append(row)
                    spread = f" ({min(r):.2f}-{max(r):.2f})" if name != VARIANTS[0] else ""
                    print(
                        f"| {qtype} | {dtype_name} | {name} | {row['weights_mib']:.0f} | {row['bytes_vs_fp32']:.1%} | "
                        f"{row['s_per_step']:.3f} | {row['ratio']:.2f}x{spread} | {row['rel_diff']:.1e} |",
                        flush=True,
                    )
                del models
                gc.collect()
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"machine": info, "args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
