"""Per-step speed of diffserve eager and `compile=True` against diffusers eager and `torch.compile`d.

Issue 8's bars, per checkpoint and resolution (fp32, CPU):

- compiled diffserve >= 1.3x faster per denoising step than eager diffusers;
- compiled diffserve not slower than diffusers whose transformer went through torch.compile (the
  faster of its two ways, `transformer.compile_repeated_blocks()` and `torch.compile(transformer)`);
- eager diffserve not slower than eager diffusers.

Checkpoints (random weights, FLUX.1 layout, T5 length 512, built once under `--model-dir`): `36m` is
`bench_flux_vs_diffusers.py`'s (2 double + 4 single blocks, 8 x 64 heads), `140m` is roofline.py's
(4 double + 6 single blocks, 12 x 64 heads). Engines, each in a fresh subprocess (this script re-invoked
with `--worker ENGINE RES`), in a rotating order per round:

| engine | what |
|---|---|
| `diffserve` | `DiffGenerator.from_pretrained(path, device="cpu", dtype="float32")` |
| `diffserve-compiled` | the same with `compile=True` (regional inductor compile of the DiT blocks, dynamic shapes) |
| `diffusers` | `FluxPipeline.from_pretrained(path, torch_dtype=torch.float32)` |
| `diffusers-compiled-regional` | the same, then `pipe.transformer.compile_repeated_blocks()` (torch.compile defaults) |
| `diffusers-compiled-full` | the same, then `pipe.transformer = torch.compile(pipe.transformer)` (defaults) |

A worker loads its pipeline (timed; `compile=True` compiles and warms up in there), runs one warm-up
generation (timed apart: where diffusers' torch.compile compiles, reported as "first call s"), then `--repeats` timed generations: s/step (the denoising steps
alone, same span for every engine), end-to-end s, peak RSS. The parent counts one step's FLOPs
(roofline.py's method: the linear layers with torch's FLOP counter on diffusers' DiT, attention
explicitly) and measures this machine's fp32 matmul rate on the DiT's own shapes before and after each
resolution's workers, giving each engine's "% of matmul rate"; and it compares every engine's image
with eager diffusers' (PSNR, same seed).

    .venv/bin/python benchmarks/bench_speed.py --model-dir /tmp/bench_speed            # all: 36m,140m x 256,512
    .venv/bin/python benchmarks/bench_speed.py --sizes 36m --resolutions 256 --steps 2 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import roofline

ENGINES = (
    "diffserve",
    "diffserve-compiled",
    "diffusers",
    "diffusers-compiled-regional",
    "diffusers-compiled-full",
)
REFERENCE = "diffusers"
DIFFUSERS_COMPILED = ("diffusers-compiled-regional", "diffusers-compiled-full")
#: (title, numerator engine(s), denominator engine, bar): numerator time / denominator time >= bar.
#: Several numerator engines: the fastest of them is the reference (named in the table).
BARS = (
    ("eager diffusers / compiled diffserve", ("diffusers",), "diffserve-compiled", 1.3),
    ("compiled diffusers / compiled diffserve", DIFFUSERS_COMPILED, "diffserve-compiled", 1.0),
    ("eager diffusers / eager diffserve", ("diffusers",), "diffserve", 1.0),
)


# --------------------------------------------------------------------------------------------- worker


def _diffserve(args: argparse.Namespace, size: int, compiled: bool):
    start = time.perf_counter()
    from diffserve.api import DiffGenerator

    imported = time.perf_counter()
    generator = DiffGenerator.from_pretrained(
        args.model_dir, device="cpu", dtype="float32", show_progress=False, compile=compiled
    )
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}

    def generate():
        out = generator.generate(
            prompt=args.prompt, height=size, width=size, num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale, max_sequence_length=args.max_sequence_length, seed=args.seed,
        )  # fmt: skip
        return out.images[0], list(out.step_times)

    return load, generate


def _diffusers(args: argparse.Namespace, size: int, compile_mode: str | None):
    import torch

    start = time.perf_counter()
    from diffusers import FluxPipeline
    from diffusers.utils import logging as diffusers_logging

    imported = time.perf_counter()
    diffusers_logging.set_verbosity_error()
    pipe = FluxPipeline.from_pretrained(args.model_dir, torch_dtype=torch.float32)
    pipe.to("cpu")
    if compile_mode == "regional":
        pipe.transformer.compile_repeated_blocks()
    elif compile_mode == "full":
        # The step timer's hook goes on the OptimizedModule, so it runs eagerly around the compiled call.
        pipe.transformer = torch.compile(pipe.transformer)
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}
    pipe.set_progress_bar_config(disable=True)
    timer = harness.DiffusersStepTimer(pipe.transformer)

    def generate():
        timer.reset()
        image = pipe(
            prompt=args.prompt, height=size, width=size, num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale, max_sequence_length=args.max_sequence_length,
            generator=torch.Generator("cpu").manual_seed(args.seed), output_type="pil",
            callback_on_step_end=timer.on_step_end,
        ).images[0]  # fmt: skip
        return image, timer.step_times(args.steps)

    return load, generate


RUNNERS = {
    "diffserve": lambda args, size: _diffserve(args, size, compiled=False),
    "diffserve-compiled": lambda args, size: _diffserve(args, size, compiled=True),
    "diffusers": lambda args, size: _diffusers(args, size, compile_mode=None),
    "diffusers-compiled-regional": lambda args, size: _diffusers(args, size, compile_mode="regional"),
    "diffusers-compiled-full": lambda args, size: _diffusers(args, size, compile_mode="full"),
}


def worker(args: argparse.Namespace, engine: str, size: int) -> None:
    # Shared dependencies first, so each engine's load time is its own imports plus from_pretrained.
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401

    load, generate = RUNNERS[engine](args, size)
    after_warmup = harness.stop_compile_workers if "compiled" in engine else None
    harness.run_timed_generations(
        engine, size, load, generate, args.repeats, args.image_out, after_warmup=after_warmup
    )


# --------------------------------------------------------------------------------------------- parent


def worker_command(
    args: argparse.Namespace, model_dir: Path, engine: str, size: int, image_out: Path
) -> list[str]:
    return [
        sys.executable, os.path.abspath(__file__), "--worker", engine, str(size),
        "--model-dir", str(model_dir), "--steps", str(args.steps), "--repeats", str(args.repeats),
        "--seed", str(args.seed), "--prompt", args.prompt, "--guidance-scale", str(args.guidance_scale),
        "--max-sequence-length", str(args.max_sequence_length), "--image-out", str(image_out),
    ]  # fmt: skip


class StepWork:
    """One denoising step's FLOPs and the DiT's matmul shapes, from diffusers' FLUX DiT on the checkpoint.

    roofline.py's method: linear FLOPs from torch's FLOP counter over one forward, attention counted
    explicitly (4 x batch x heads x tokens^2 x head_dim per block). FLUX.1-dev's guidance is embedded,
    so one step is one forward of batch 1.
    """

    def __init__(self, model_dir: Path, text_len: int) -> None:
        import torch
        from diffusers import FluxTransformer2DModel
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
        self.model = FluxTransformer2DModel.from_pretrained(
            model_dir / "transformer", torch_dtype=torch.float32
        )
        self.model.eval().requires_grad_(False)
        self.config = json.loads((model_dir / "transformer" / "config.json").read_text())
        self.text_len = text_len

    @property
    def dim(self) -> int:
        return self.config["num_attention_heads"] * self.config["attention_head_dim"]

    def tokens(self, size: int) -> int:
        return self.text_len + (size // roofline.PIXELS_PER_TOKEN_SIDE) ** 2

    def flops(self, size: int) -> int:
        import torch

        inputs = roofline.make_inputs(self.config, size, 1, self.text_len, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            counted = roofline.count_forward_flops(
                lambda: roofline.diffusers_forward(self.model, inputs), roofline._sdpa_recorder_class()
            )
        tokens = self.tokens(size)
        blocks = self.config["num_layers"] + self.config["num_single_layers"]
        heads, head_dim = self.config["num_attention_heads"], self.config["attention_head_dim"]
        return counted["linear_flops"] + blocks * roofline.attention_flops(1, heads, tokens, tokens, head_dim)


def run_resolution(
    args: argparse.Namespace, model_dir: Path, work: StepWork, size: int, image_dir: Path, tag: str
) -> dict:
    """Every engine's workers at one resolution (rotating order per round), pooled, with FLOPs and rate."""
    import torch

    step_flops = work.flops(size)
    probe = roofline.MatmulProbe(
        roofline.dit_matmul_shapes(work.tokens(size), work.dim),
        torch.float32,
        torch.device("cpu"),
        args.mm_warmup,
    )
    probe.sample(args.mm_repeats)
    per_engine: dict[str, list[dict]] = {e: [] for e in args.engines}
    for round_ in range(args.rounds):
        shift = round_ % len(args.engines)
        for engine in args.engines[shift:] + args.engines[:shift]:
            image_out = image_dir / f"{tag}_{engine}_{size}_r{round_}.png"
            cmd = worker_command(args, model_dir, engine, size, image_out)
            per_engine[engine].append(harness.run_worker(cmd, engine, size, args.worker_timeout, f"{tag} "))
        probe.sample(args.mm_repeats)
    rows = {e: harness.merge_rounds(results) for e, results in per_engine.items()}
    rate = probe.summary()
    for row in rows.values():
        row["step_gflops"] = step_flops / 1e9
        row["pct_of_matmul_rate"] = 100.0 * step_flops / row["s_per_step"] / 1e9 / rate["best_gflops"]
        if REFERENCE in rows:
            row["psnr_vs_diffusers_db"] = harness.image_psnr(row["image"], rows[REFERENCE]["image"])
    return {"rows": rows, "matmul_rate": rate, "step_flops": step_flops}


# ------------------------------------------------------------------------------------------- rendering


def bar_cells(rows: dict[str, dict]) -> list[str]:
    """Per bar: 'ratio (PASS|MISS)', naming the faster diffusers compile mode; '-' without its engines."""
    cells = []
    for _title, numerators, denominator, bar in BARS:
        present = [e for e in numerators if e in rows]
        if not present or denominator not in rows:
            cells.append("-")
            continue
        best = min(present, key=lambda e: rows[e]["s_per_step"])
        ratio = rows[best]["s_per_step"] / rows[denominator]["s_per_step"]
        which = f" ({best.rsplit('-', 1)[-1]})" if len(numerators) > 1 else ""
        cells.append(f"**{ratio:.2f}x**{which} {'PASS' if ratio >= bar else 'MISS'}")
    return cells


def _first_call(row: dict) -> str:
    return ", ".join(f"{s:.1f}" for s in row.get("warmup_s", [])) or "-"


def _ready(row: dict) -> str:
    """Load + first call, mean over workers: the time to a first image, compilation included wherever
    the engine does it (diffserve compiles inside from_pretrained, diffusers on the first call)."""
    warmups = row.get("warmup_s", [])
    return f"{row['load_s'] + sum(warmups) / len(warmups):.1f}" if warmups else "-"


def render(info: dict, args: argparse.Namespace, results: dict[str, dict]) -> str:
    out = [
        "# diffserve eager / compiled vs diffusers eager / compiled (FLUX.1 layout)",
        "",
        *harness.machine_lines(info),
        f"- fp32, CPU, {args.steps} steps, guidance {args.guidance_scale} (embedded: one DiT forward of batch 1 "
        f"per step), T5 length {args.max_sequence_length}, seed {args.seed}, {args.repeats} timed runs per worker "
        f"after 1 warm-up, {args.rounds} worker(s) per engine, checkpoint and resolution",
        "",
    ]
    bar_titles = " | ".join(f"{title} (bar {bar:g}x)" for title, _n, _d, bar in BARS)
    summary = [f"| checkpoint | resolution | {bar_titles} |", "|---|---|" + "---:|" * len(BARS)]
    for name, per_size in results.items():
        out += [
            f"## {name}: DiT {per_size['dit_parameters']:,} parameters",
            "",
            "| resolution | engine | load s | first call s | load + first call s | s/step | end-to-end s "
            "| peak RSS MB | % of matmul rate | PSNR vs diffusers dB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        notes = []
        for size in args.sizes:
            res = per_size["resolutions"][str(size)]
            rows = res["rows"]
            for engine in args.engines:
                r = rows[engine]
                psnr = r.get("psnr_vs_diffusers_db")
                out.append(
                    f"| {size}x{size} | {engine} | {r['load_s']:.2f} | {_first_call(r)} | {_ready(r)} | {r['s_per_step']:.3f} "
                    f"| {r['e2e_mean_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['pct_of_matmul_rate']:.1f}% "
                    f"| {'-' if psnr is None else harness.psnr_cell(psnr)} |"
                )
                steps = ", ".join(f"{t:.3f}" for run in r["step_times_s"] for t in run)
                loads = ", ".join(f"{x:.1f}" for x in r["loadavg_1m"])
                notes.append(
                    f"- {name} {size}x{size} {engine}: s per step [{steps}]; 1-min load before/after [{loads}]"
                )
            summary.append(f"| {name} | {size}x{size} | " + " | ".join(bar_cells(rows)) + " |")
            rate = res["matmul_rate"]
            notes.append(
                f"- {name} {size}x{size}: step {res['step_flops'] / 1e9:.2f} GFLOP; matmul rate best "
                f"{rate['best_gflops']:.1f} GFLOP/s (median {rate['median_gflops']:.1f})"
            )
        out += [
            *harness.contention_lines(args.sizes, {s: per_size["resolutions"][str(s)]["rows"] for s in args.sizes},
                                      info["torch_threads"]),
            "",
            "Raw timings:",
            *notes,
            "",
        ]  # fmt: skip
    out += [
        "## Bars (s/step ratios; >1 means diffserve is faster)",
        "",
        *summary,
        "",
        '"first call s" is each worker\'s warm-up generation (one value per worker): diffusers compiles there, '
        "diffserve compiles inside from_pretrained (`compile=True` warms up at a small size), so compare "
        '"load + first call s", the time to a first image. % of matmul rate = the step\'s FLOPs / s per step / the best torch.mm '
        "GFLOP/s this machine showed on the DiT's shapes (roofline.py's method; elementwise work costs time but "
        "no matmul FLOPs, so 100% is out of reach). PSNR compares each engine's image with eager diffusers' for "
        f"the same seed (bar {harness.PSNR_BAR_DB:g} dB). A 1-min load average above the torch thread count + "
        f"{harness.CONTENTION_MARGIN:g} means other processes competed for the CPU: rerun on an idle machine.",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------- CLI


def check_selection(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Split `--sizes` into `args.checkpoints` and `--engines` into a list (exits on an unknown name).

    `harness.check_run_args` made `args.sizes` the resolutions, hence the separate name.
    """
    args.checkpoints = [s.strip() for s in args.checkpoint_sizes.split(",") if s.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for name in args.checkpoints:
        if name not in roofline.CHECKPOINT_SPECS:
            p.error(f"unknown size {name!r}; choose from {', '.join(roofline.CHECKPOINT_SPECS)}")
    for engine in args.engines:
        if engine not in ENGINES:
            p.error(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


def add_selection_args(p: argparse.ArgumentParser, **run_args: object) -> None:
    """Checkpoint folder, resolutions, timing, `--sizes`, `--engines` and the FLUX generation settings
    (`run_args` go to `harness.add_run_args`)."""
    harness.add_run_args(
        p, "256,512", "parent folder of the checkpoints (one sub-folder per size, built there if missing); "
        "default: a temporary folder", **run_args,
    )  # fmt: skip
    p.add_argument(
        "--sizes", dest="checkpoint_sizes", default="36m,140m",
        help="comma-separated checkpoints: 36m, 140m (default: both)",
    )  # fmt: skip
    p.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}"
    )
    p.add_argument("--guidance-scale", type=float, default=3.5)
    p.add_argument("--max-sequence-length", type=int, default=512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_args(p)
    p.add_argument("--mm-repeats", type=int, default=10, help="timed torch.mm calls per shape per sample")
    p.add_argument("--mm-warmup", type=int, default=3, help="untimed torch.mm calls per shape first")
    harness.add_output_args(p)
    args = p.parse_args(argv)
    if args.worker:
        return args
    harness.check_run_args(p, args, size_multiple=roofline.PIXELS_PER_TOKEN_SIDE)
    check_selection(p, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        engine, size = args.worker
        if engine not in RUNNERS:
            raise SystemExit(f"unknown engine {engine!r}")
        worker(args, engine, int(size))
        return

    with tempfile.TemporaryDirectory(prefix="diffserve-bench-speed-") as tmp:
        parent = (args.model_dir or Path(tmp)).resolve()
        image_dir = (args.image_dir or Path(tmp) / "images").resolve()
        image_dir.mkdir(parents=True, exist_ok=True)
        info = harness.machine_info()
        results: dict[str, Any] = {}
        for name in args.checkpoints:
            model_dir = parent / f"flux_{name}"
            roofline.prepare_checkpoint(model_dir, name)
            work = StepWork(model_dir, args.max_sequence_length)
            results[name] = {
                "dit_parameters": harness.dit_parameter_count(model_dir),
                "resolutions": {
                    str(size): run_resolution(args, model_dir, work, size, image_dir, name)
                    for size in args.sizes
                },
            }
            del work
        print(render(info, args, results))
        if args.json:
            payload = {"machine": info, "settings": harness.settings_for_json(args), "results": results}
            harness.write_json(args.json, payload)


if __name__ == "__main__":
    main()
