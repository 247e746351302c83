"""How close each engine's FLUX DiT step gets to this machine's measured matmul rate.

A DiT step is dominated by matrix multiplies, so the ceiling for a lossless engine is the rate at which
this machine multiplies matrices of the DiT's own shapes. Per resolution the script

1. measures that rate: `torch.mm` on the DiT's shapes ((batch x (text + image tokens)) x dim @ dim x
   3dim, 4dim, ... in the dtype in use), warm-up excluded, `--mm-repeats` timed calls per shape before
   and after each block of timed forwards (so it sees the same machine conditions), best and median;
2. counts one step's FLOPs: the linear layers with `torch.utils.flop_counter.FlopCounterMode` on one
   forward of diffusers' model and of diffserve's native model (diffserve's is lower: its last
   single-stream block skips the text rows' queries, MLP and output projection, whose results nothing
   reads; both rates below are computed from diffusers' count, the same useful work), and attention
   explicitly, since the counter does not see CPU SDPA: 4 * batch * heads * q_len * kv_len * head_dim
   per attention call (QK^T and PV). The SDPA calls each forward really makes are recorded as a check;
3. times one DiT forward (a FLUX step is one forward; `--cfg` doubles its batch) of diffserve's native
   `FluxTransformer2DModel` and diffusers' `FluxTransformer2DModel`, loaded from the same checkpoint
   folder in this one process, alternating A/B (the order flipped every round so drift cancels), and
   with `--compile` also both `torch.compile`d (inductor, default mode, static shapes, warm-up excluded);
4. prints achieved GFLOP/s and % of the measured matmul rate side by side, and the speed ratio.

    .venv/bin/python benchmarks/roofline.py                              # 36m, 256 and 512, 5 repeats
    .venv/bin/python benchmarks/roofline.py --size 140m --resolutions 256 --compile --json out.json

Each engine is timed as its own denoising step calls it: diffserve gets the RoPE tables precomputed
once per shape (its pipeline caches them), diffusers builds them from the ids inside every forward.
Both achieved rates are computed from the same work (diffusers' FLOP count), so their ratio is the
speed ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_flux_vs_diffusers
import harness

ENGINES = ("diffserve", "diffusers")
DTYPES = ("float32", "bfloat16", "float16")
#: FLUX packs 2x2 latent patches of an 8x-downsampled VAE latent: one image token per 16x16 pixels.
PIXELS_PER_TOKEN_SIDE = 16


def checkpoint_spec_140m():
    """The ~140M-parameter variant: FLUX block shapes, deeper and wider than the 36m benchmark checkpoint.

    4 double + 6 single blocks, 12 heads x 64 (width 768): a 142,005,056-parameter DiT, about 4x the
    36m one's work per token, so the roofline is checked where matmuls are larger and weights no longer
    fit in cache.
    """
    from diffserve.families.flux.tiny import TinyFluxSpec

    return TinyFluxSpec(
        num_layers=4,
        num_single_layers=6,
        num_attention_heads=12,
        attention_head_dim=64,
        axes_dims_rope=(16, 24, 24),
        guidance_embeds=True,
        latent_channels=16,
        vae_block_out_channels=(32, 64, 128, 128),
        vae_norm_num_groups=32,
        text_hidden_size=256,
        text_layers=2,
        t5_max_length=512,
        seed=0,
    )


#: `--size` -> the checkpoint spec builder. 36m is `bench_flux_vs_diffusers.py`'s checkpoint.
CHECKPOINT_SPECS = {"36m": bench_flux_vs_diffusers.checkpoint_spec, "140m": checkpoint_spec_140m}


# ------------------------------------------------------------------------------------------ device sync


def synchronize(device: Any) -> None:
    """Wait for queued kernels, so a wall-clock interval covers the work (a no-op on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ----------------------------------------------------------------------------------------- matmul rate


def dit_matmul_shapes(rows: int, dim: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the DiT's token-wise matmuls at `rows` = batch x tokens: QKV, MLP up/down, single out."""
    return [
        (rows, dim, 3 * dim),  # q, k, v projections (one fused, or three of dim each)
        (rows, dim, 4 * dim),  # MLP up
        (rows, 4 * dim, dim),  # MLP down
        (rows, 5 * dim, dim),  # single-block proj_out over [attention; MLP]
    ]


class MatmulProbe:
    """GFLOP/s of `torch.mm` on the DiT's shapes, sampled repeatedly alongside the engines' timings.

    `sample()` is called before and after each block of timed forwards, so the reference rate is
    measured under the same machine conditions as the steps it is compared with. The machine's
    reference rate is the best of the per-shape best rates over all samples: what this hardware has
    shown it can sustain on the DiT's own shapes, and so the ceiling an engine's step is measured against.
    """

    def __init__(self, shapes: list[tuple[int, int, int]], dtype: Any, device: Any, warmup: int) -> None:
        import torch

        gen = torch.Generator("cpu").manual_seed(0)
        self.device = device
        self.operands = []
        for m, k, n in shapes:
            a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
            self.operands.append((a, b, torch.empty(m, n, device=device, dtype=dtype)))
        self.shapes = shapes
        self.times: list[list[float]] = [[] for _ in shapes]
        for a, b, out in self.operands:
            for _ in range(warmup):
                torch.mm(a, b, out=out)
        synchronize(device)

    def sample(self, repeats: int) -> None:
        """`repeats` timed calls of each shape."""
        import torch

        for (a, b, out), times in zip(self.operands, self.times, strict=True):
            for _ in range(repeats):
                start = time.perf_counter()
                torch.mm(a, b, out=out)
                synchronize(self.device)
                times.append(time.perf_counter() - start)

    def best_gflops(self) -> float:
        return max(2 * m * k * n / min(t) / 1e9 for (m, k, n), t in zip(self.shapes, self.times, strict=True))

    def summary(self) -> dict:
        rows = [
            {
                "shape": [m, k, n],
                "best_gflops": 2 * m * k * n / min(t) / 1e9,
                "median_gflops": 2 * m * k * n / statistics.median(t) / 1e9,
                "samples": len(t),
            }
            for (m, k, n), t in zip(self.shapes, self.times, strict=True)
        ]
        return {
            "shapes": rows,
            "best_gflops": max(r["best_gflops"] for r in rows),
            "median_gflops": statistics.median(r["median_gflops"] for r in rows),
        }


# ---------------------------------------------------------------------------------------- FLOP counting


def _sdpa_recorder_class():
    """A dispatch mode that records every SDPA call's (batch, heads, q_len, kv_len, head_dim).

    Built lazily so importing this script does not import torch.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class SdpaRecorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[int, int, int, int, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                q, k = args[0], args[1]  # (batch, heads, seq, head_dim) at the aten level
                self.calls.append((q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3]))
            return func(*args, **(kwargs or {}))

    return SdpaRecorder


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int) -> int:
    """QK^T and PV: two matmuls of 2 * q_len * kv_len * head_dim FLOPs per batch row and head."""
    return 4 * batch * heads * q_len * kv_len * head_dim


def count_forward_flops(forward, sdpa_recorder_cls) -> dict:
    """Run `forward()` once under the FLOP counter and the SDPA recorder.

    Returns the linear-layer FLOPs (everything the counter saw except attention ops, which it only
    sees on some GPUs), the counter's per-op breakdown, and the recorded attention calls and FLOPs.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    recorder = sdpa_recorder_cls()
    with counter, recorder:
        forward()
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    linear = sum(n for op, n in by_op.items() if "attention" not in op and "scaled_dot_product" not in op)
    return {
        "linear_flops": linear,
        "counter_by_op": by_op,
        "attention_calls": len(recorder.calls),
        "attention_flops_recorded": sum(attention_flops(*c) for c in recorder.calls),
    }


# ------------------------------------------------------------------------------------------ the models


@dataclass
class Inputs:
    """One DiT forward's inputs, shared by both engines (diffserve also gets its precomputed RoPE)."""

    hidden_states: Any
    encoder_hidden_states: Any
    pooled_projections: Any
    timestep: Any
    img_ids: Any
    txt_ids: Any
    guidance: Any
    rope: Any = None


def make_inputs(config: dict, size: int, batch: int, text_len: int, dtype: Any, device: Any) -> Inputs:
    """Random latents and text states of the request shape; each batch row at its own timestep."""
    import torch

    gen = torch.Generator("cpu").manual_seed(0)
    side = size // PIXELS_PER_TOKEN_SIDE
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    guidance = torch.full((batch,), 3.5) if config.get("guidance_embeds") else None

    def to(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    return Inputs(
        hidden_states=to(torch.randn(batch, side * side, config["in_channels"], generator=gen)),
        encoder_hidden_states=to(torch.randn(batch, text_len, config["joint_attention_dim"], generator=gen)),
        pooled_projections=to(torch.randn(batch, config["pooled_projection_dim"], generator=gen)),
        timestep=to(torch.linspace(0.9, 0.3, batch)),  # sigma in [0, 1]; both models scale by 1000
        img_ids=to(img_ids),
        txt_ids=to(torch.zeros(text_len, 3)),
        guidance=to(guidance),
    )


def diffserve_forward(model, inputs: Inputs):
    return model(
        hidden_states=inputs.hidden_states,
        encoder_hidden_states=inputs.encoder_hidden_states,
        pooled_projections=inputs.pooled_projections,
        timestep=inputs.timestep,
        img_ids=inputs.img_ids,
        txt_ids=inputs.txt_ids,
        guidance=inputs.guidance,
        rope=inputs.rope,
    )


def diffusers_forward(model, inputs: Inputs):
    return model(
        hidden_states=inputs.hidden_states,
        encoder_hidden_states=inputs.encoder_hidden_states,
        pooled_projections=inputs.pooled_projections,
        timestep=inputs.timestep,
        img_ids=inputs.img_ids,
        txt_ids=inputs.txt_ids,
        guidance=inputs.guidance,
        return_dict=False,
    )[0]


FORWARDS = {"diffserve": diffserve_forward, "diffusers": diffusers_forward}


def load_models(model_dir: Path, dtype_name: str, device_name: str) -> dict[str, Any]:
    """Both engines' DiTs from the same folder: diffserve's as its generator loads it, diffusers' directly."""
    import torch
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import logging as diffusers_logging

    from diffserve.api import DiffGenerator

    diffusers_logging.set_verbosity_error()
    generator = DiffGenerator.from_pretrained(
        model_dir, device=device_name, dtype=dtype_name, show_progress=False
    )
    ours = generator.pipeline.context.get("transformer")
    ref = FluxTransformer2DModel.from_pretrained(
        model_dir / "transformer", torch_dtype=getattr(torch, dtype_name)
    )
    ref = ref.to(device_name).eval().requires_grad_(False)
    return {"diffserve": ours.eval(), "diffusers": ref}


# --------------------------------------------------------------------------------------------- timing


def time_alternating(calls: dict[str, Any], repeats: int, warmup: int, device: Any) -> dict[str, list[float]]:
    """Seconds of each engine's call, `warmup` untimed calls each first, then `repeats` rounds A/B.

    The order flips every round (A B, B A, A B, ...) so a slow drift of the machine's speed (thermal,
    another process) falls on both engines alike.
    """
    for name in ENGINES:
        for _ in range(warmup):
            calls[name]()
        synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in ENGINES}
    for round_ in range(repeats):
        for name in ENGINES if round_ % 2 == 0 else reversed(ENGINES):
            start = time.perf_counter()
            calls[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def achieved(times: list[float], step_flops: int, matmul_gflops: float) -> dict:
    median = statistics.median(times)
    gflops = step_flops / median / 1e9
    return {
        "times_s": times,
        "median_s": median,
        "best_s": min(times),
        "gflops": gflops,
        "pct_of_matmul_rate": 100.0 * gflops / matmul_gflops,
    }


def run_resolution(args: argparse.Namespace, models: dict, compiled: dict, config: dict, size: int) -> dict:
    """Matmul rate, FLOP count and timings at one resolution."""
    import torch

    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    batch = args.batch * (2 if args.cfg else 1)
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    dim = heads * head_dim
    image_tokens = (size // PIXELS_PER_TOKEN_SIDE) ** 2
    tokens = args.max_sequence_length + image_tokens
    load_before = os.getloadavg()[0]

    print(f"[{size}x{size}] measuring the matmul rate ...", file=sys.stderr, flush=True)
    # Linear layers multiply every token of every batch row at once: M = batch x tokens.
    probe = MatmulProbe(dit_matmul_shapes(batch * tokens, dim), dtype, device, args.mm_warmup)
    probe.sample(args.mm_repeats)

    inputs = make_inputs(config, size, batch, args.max_sequence_length, dtype, device)
    ours_inputs = Inputs(**vars(inputs))
    if hasattr(models["diffserve"], "rope_tables"):  # as diffserve's step calls it: RoPE cached per shape
        ours_inputs.rope = models["diffserve"].rope_tables(inputs.txt_ids, inputs.img_ids)
    engine_inputs = {"diffserve": ours_inputs, "diffusers": inputs}

    print(f"[{size}x{size}] counting FLOPs ...", file=sys.stderr, flush=True)
    recorder_cls = _sdpa_recorder_class()
    counts, outputs = {}, {}
    with torch.inference_mode():
        for name in ENGINES:
            counts[name] = count_forward_flops(
                lambda name=name: outputs.__setitem__(
                    name, FORWARDS[name](models[name], engine_inputs[name])
                ),
                recorder_cls,
            )
    n_attention = config["num_layers"] + config["num_single_layers"]  # one joint attention per block
    attn_flops = n_attention * attention_flops(batch, heads, tokens, tokens, head_dim)
    step_flops = counts["diffusers"]["linear_flops"] + attn_flops
    max_abs_diff = (outputs["diffserve"].float() - outputs["diffusers"].float()).abs().max().item()

    def calls_of(table: dict) -> dict:
        return {
            name: (lambda name=name: FORWARDS[name](table[name], engine_inputs[name])) for name in ENGINES
        }

    compile_s, compiled_times = None, {}
    with torch.inference_mode():
        print(f"[{size}x{size}] timing eager forwards ...", file=sys.stderr, flush=True)
        eager_times = time_alternating(calls_of(models), args.repeats, args.warmup, device)
        probe.sample(args.mm_repeats)
        if compiled:
            print(
                f"[{size}x{size}] compiling (warm-up, not timed) and timing ...", file=sys.stderr, flush=True
            )
            compile_start = time.perf_counter()
            for name in ENGINES:  # the first call compiles this shape; its time is reported, not timed
                calls_of(compiled)[name]()
            compile_s = time.perf_counter() - compile_start
            compiled_times = time_alternating(calls_of(compiled), args.repeats, args.warmup, device)
            probe.sample(args.mm_repeats)
    rate = probe.summary()
    timings = {"eager": {n: achieved(eager_times[n], step_flops, rate["best_gflops"]) for n in ENGINES}}
    if compiled:
        timings["compiled"] = {
            n: achieved(compiled_times[n], step_flops, rate["best_gflops"]) for n in ENGINES
        }

    return {
        "resolution": size,
        "batch": batch,
        "text_tokens": args.max_sequence_length,
        "image_tokens": image_tokens,
        "matmul_rate": rate,
        "flops": {
            "linear": {n: counts[n]["linear_flops"] for n in ENGINES},
            "attention_explicit": attn_flops,
            "attention_calls_expected": n_attention,
            "attention_calls_seen": {n: counts[n]["attention_calls"] for n in ENGINES},
            "attention_recorded": {n: counts[n]["attention_flops_recorded"] for n in ENGINES},
            "counter_by_op": {n: counts[n]["counter_by_op"] for n in ENGINES},
            "step": step_flops,
        },
        "output_max_abs_diff": max_abs_diff,
        "timings": timings,
        "compile_warmup_s": compile_s,
        "loadavg_1m": [load_before, os.getloadavg()[0]],
    }


# ------------------------------------------------------------------------------------------ rendering


def _g(flops: float) -> str:
    return f"{flops / 1e9:.2f}"


def render(info: dict, args: argparse.Namespace, dit_params: int, config: dict, results: list[dict]) -> str:
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    out = [
        f"# Roofline: FLUX DiT step vs this machine's matmul rate ({args.size})",
        "",
        *harness.machine_lines(info),
        f"- checkpoint: FLUX.1 layout, DiT {dit_params:,} parameters ({config['num_layers']} double + "
        f"{config['num_single_layers']} single blocks, {config['num_attention_heads']}x"
        f"{config['attention_head_dim']} heads, width {dim}), T5 length {args.max_sequence_length}",
        f"- {args.dtype} on {args.device}, DiT batch {results[0]['batch']} per step"
        f"{' (CFG on: 2 x ' + str(args.batch) + ')' if args.cfg else ' (CFG off, as guidance-distilled FLUX)'}, "
        f"{args.repeats} timed forwards per engine after {args.warmup} warm-up, alternating A/B; "
        f"matmul: {args.mm_repeats} timed calls per shape before and after each timing block, "
        f"after {args.mm_warmup} warm-up",
        "",
        "## Matmul rate (torch.mm, the DiT's shapes)",
        "",
        "| resolution | M x K @ K x N | best GFLOP/s | median GFLOP/s |",
        "|---|---|---:|---:|",
    ]
    for r in results:
        for s in r["matmul_rate"]["shapes"]:
            m, k, n = s["shape"]
            out.append(
                f"| {r['resolution']}x{r['resolution']} | {m} x {k} @ {k} x {n} "
                f"| {s['best_gflops']:.1f} | {s['median_gflops']:.1f} |"
            )
        out.append(
            f"| {r['resolution']}x{r['resolution']} | **reference rate** "
            f"| **{r['matmul_rate']['best_gflops']:.1f}** | {r['matmul_rate']['median_gflops']:.1f} |"
        )
    out += [
        "",
        "## FLOPs per step (one DiT forward)",
        "",
        "| resolution | tokens (text + image) | linear GFLOP diffusers | linear GFLOP diffserve "
        "| attention GFLOP | SDPA calls seen (diffserve / diffusers) | step GFLOP |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    warnings = []
    for r in results:
        f = r["flops"]
        res = f"{r['resolution']}x{r['resolution']}"
        seen = f["attention_calls_seen"]
        out.append(
            f"| {res} | {r['text_tokens']} + {r['image_tokens']} | {_g(f['linear']['diffusers'])} "
            f"| {_g(f['linear']['diffserve'])} | {_g(f['attention_explicit'])} "
            f"| {seen['diffserve']} / {seen['diffusers']} (expected {f['attention_calls_expected']}) "
            f"| **{_g(f['step'])}** |"
        )
        if f["linear"]["diffserve"] > f["linear"]["diffusers"]:
            warnings.append(f"{res}: diffserve counts more linear FLOPs than diffusers")
        for name in ENGINES:
            recorded = f["attention_recorded"][name]
            # diffserve's last block attends from the image rows only, so it may record less.
            off = (
                recorded > f["attention_explicit"]
                if name == "diffserve"
                else recorded != f["attention_explicit"]
            )
            if seen[name] and off:
                warnings.append(
                    f"{res}: {name}'s recorded SDPA calls add up to {_g(f['attention_recorded'][name])} GFLOP"
                )
        if max(r["loadavg_1m"]) > info["torch_threads"] + harness.CONTENTION_MARGIN:
            warnings.append(
                f"{res}: **CPU contention** (1-min load up to {max(r['loadavg_1m']):.1f} with "
                f"{info['torch_threads']} torch threads); these timings are unreliable, rerun on an idle machine"
            )
    out += [
        "",
        "## Achieved rate per step",
        "",
        "| resolution | mode | engine | s/step (median) | best s | GFLOP/s | % of matmul rate |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        res = f"{r['resolution']}x{r['resolution']}"
        for mode, t in r["timings"].items():
            for name in ENGINES:
                e = t[name]
                out.append(
                    f"| {res} | {mode} | {name} | {e['median_s']:.4f} | {e['best_s']:.4f} | {e['gflops']:.1f} "
                    f"| {e['pct_of_matmul_rate']:.1f}% |"
                )
            ratio = t["diffusers"]["median_s"] / t["diffserve"]["median_s"]
            out.append(f"| {res} | {mode} | **diffusers/diffserve** | **{ratio:.2f}x** | | | |")
        if "compiled" in r["timings"]:
            t = r["timings"]
            ratio = t["eager"]["diffusers"]["median_s"] / t["compiled"]["diffserve"]["median_s"]
            out.append(f"| {res} | | **eager diffusers / compiled diffserve** | **{ratio:.2f}x** | | | |")
    out += [
        "",
        "Output check (same weights, same inputs): max |diffserve - diffusers| = "
        + ", ".join(f"{r['output_max_abs_diff']:.2e} at {r['resolution']}" for r in results),
    ]
    for r in results:
        if r["compile_warmup_s"] is not None:
            out.append(
                f"- {r['resolution']}x{r['resolution']}: torch.compile warm-up (first call of both engines, "
                f"not timed) {r['compile_warmup_s']:.1f} s"
            )
    if warnings:
        out += ["", "**Warnings:**", *[f"- {w}" for w in warnings]]
    out += [
        "",
        "GFLOP/s = the step's FLOPs (diffusers' linear count + explicit attention) / median s/step; % of matmul "
        "rate = that / the resolution's reference rate (best torch.mm GFLOP/s over the DiT's shapes). The "
        "ratio is diffusers / diffserve time: >1 means diffserve is faster. Elementwise work (norms, RoPE, "
        "activations, modulation) is not counted: it costs time but no matmul FLOPs. diffserve skips the "
        "last block's unread text rows (its linear GFLOP column), so its rate can exceed what its kernels "
        "achieve; that work saved is part of its speed.",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(CHECKPOINT_SPECS), default="36m", help="DiT size (default: 36m)")
    p.add_argument(
        "--model-dir", type=Path, default=None,
        help="checkpoint folder to reuse (built there for --size if missing); default: a temporary folder",
    )  # fmt: skip
    p.add_argument("--resolutions", default="256,512", help="comma-separated square sizes (default: 256,512)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per engine and mode (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards per engine first (default: 1)")
    p.add_argument("--mm-repeats", type=int, default=10, help="timed torch.mm calls per shape (default: 10)")
    p.add_argument("--mm-warmup", type=int, default=3, help="untimed torch.mm calls per shape (default: 3)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--batch", type=int, default=1, help="requests per step (default: 1)")
    p.add_argument("--cfg", action="store_true", help="CFG on: the DiT batch is 2 x --batch")
    p.add_argument("--max-sequence-length", type=int, default=512, help="T5 text tokens (default: 512)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd models (inductor)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.resolutions.split(",") if s.strip()]
    for size in args.sizes:
        if size <= 0 or size % PIXELS_PER_TOKEN_SIDE:
            p.error(f"resolution {size} must be a positive multiple of {PIXELS_PER_TOKEN_SIDE}")
    if min(args.repeats, args.mm_repeats, args.batch) < 1 or min(args.warmup, args.mm_warmup) < 0:
        p.error("--repeats, --mm-repeats and --batch must be >= 1; warm-ups >= 0")
    return args


def prepare_checkpoint(model_dir: Path, size: str) -> None:
    if (model_dir / "model_index.json").exists():
        print(f"Reusing checkpoint at {model_dir}", file=sys.stderr)
        return
    from diffserve.families.flux.tiny import build_tiny_flux

    print(f"Building the {size} checkpoint at {model_dir} ...", file=sys.stderr)
    start = time.perf_counter()
    build_tiny_flux(model_dir, CHECKPOINT_SPECS[size]())
    print(f"  built in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory(prefix="diffserve-roofline-") as tmp:
        model_dir = (args.model_dir or Path(tmp) / f"flux_{args.size}").resolve()
        prepare_checkpoint(model_dir, args.size)
        config = json.loads((model_dir / "transformer" / "config.json").read_text())
        dit_params = harness.dit_parameter_count(model_dir)
        info = harness.machine_info()
        print(f"DiT parameters: {dit_params:,}; loading both engines ...", file=sys.stderr, flush=True)
        models = load_models(model_dir, args.dtype, args.device)
        # Static shapes: each resolution gets its own graph, as a server warmed up per size would.
        compiled = {n: torch.compile(m, dynamic=False) for n, m in models.items()} if args.compile else {}
        results = [run_resolution(args, models, compiled, config, size) for size in args.sizes]

    print(render(info, args, dit_params, config, results))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        payload = {"machine": info, "dit_parameters": dit_params, "settings": settings, "results": results}
        harness.write_json(args.json, payload)


if __name__ == "__main__":
    main()
