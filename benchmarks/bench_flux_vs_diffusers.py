"""diffserve vs diffusers' `FluxPipeline`: same checkpoint, same machine, same run.

Builds (or reuses) a random-weight FLUX.1 checkpoint of realistic block shape (2 double + 4 single
blocks, 8 heads x 64, ~36M-parameter DiT, T5 length 512, a 4-level VAE) and times both engines on it.
Every measurement runs in a fresh subprocess (this script re-invoked with `--worker ENGINE RES`), the
engines alternating, so peak RSS is per engine and neither engine inherits the other's warm caches.
Each worker loads the pipeline (timed), runs one uncounted warm-up generation, then times `--repeats`
generations. The parent compares the two engines' images (same seed) and reports their PSNR next to
the speed figures, so a speed-up can never hide a wrong picture.

    .venv/bin/python benchmarks/bench_flux_vs_diffusers.py                      # 256,512; 4 steps; 2 repeats
    .venv/bin/python benchmarks/bench_flux_vs_diffusers.py --resolutions 256 --repeats 3 --json out.json

Ratios are diffusers / diffserve: above 1 means diffserve is faster (or, for RSS, smaller).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffserve.testing.image_metrics import psnr_uint8 as psnr

ENGINES = ("diffserve", "diffusers")
RESULT_MARKER = "BENCH_RESULT "
PSNR_BAR_DB = 40.0  # DESIGN.md correctness bar for whole generations
#: A worker keeps about `torch_threads` cores busy; a 1-min load average above that plus this margin
#: means other processes competed for the CPU during its measurement.
CONTENTION_MARGIN = 1.0


def checkpoint_spec():
    """The benchmark checkpoint: FLUX block shapes at reduced depth; small text encoders."""
    from diffserve.testing.tiny_flux import TinyFluxSpec

    return TinyFluxSpec(
        num_layers=2,
        num_single_layers=4,
        num_attention_heads=8,
        attention_head_dim=64,
        axes_dims_rope=(16, 24, 24),
        guidance_embeds=True,
        latent_channels=16,
        vae_block_out_channels=(32, 64, 128, 128),
        vae_norm_num_groups=32,
        text_hidden_size=256,  # = joint_attention_dim = pooled_projection_dim -> ~36.6M DiT parameters
        text_layers=2,
        t5_max_length=512,
        seed=0,
    )


# --------------------------------------------------------------------------------------------- worker


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _run_diffserve(args: argparse.Namespace, size: int):
    start = time.perf_counter()
    from diffserve.api import DiffGenerator

    imported = time.perf_counter()
    generator = DiffGenerator.from_pretrained(args.model_dir, device="cpu", dtype="float32", show_progress=False)
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}

    def generate():
        out = generator.generate(
            prompt=args.prompt,
            height=size,
            width=size,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            max_sequence_length=args.max_sequence_length,
            seed=args.seed,
        )
        return out.images[0], list(out.step_times)

    return load, generate


def _run_diffusers(args: argparse.Namespace, size: int):
    import torch

    start = time.perf_counter()
    from diffusers import FluxPipeline
    from diffusers.utils import logging as diffusers_logging

    imported = time.perf_counter()
    diffusers_logging.set_verbosity_error()
    pipe = FluxPipeline.from_pretrained(args.model_dir, torch_dtype=torch.float32)
    pipe.to("cpu")
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}
    pipe.set_progress_bar_config(disable=True)  # diffserve runs with its progress bar off too

    # One step = from the step's first transformer call to the end of its scheduler step (the
    # callback), the same span diffserve's step_times cover (inputs -> DiT -> scheduler.step).
    starts: list[float] = []
    ends: list[float] = []

    def on_transformer_call(module, inputs):
        if len(starts) == len(ends):  # first DiT call of this step (true CFG would call twice)
            starts.append(time.perf_counter())

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        ends.append(time.perf_counter())
        return callback_kwargs

    pipe.transformer.register_forward_pre_hook(on_transformer_call)

    def generate():
        starts.clear()
        ends.clear()
        image = pipe(
            prompt=args.prompt,
            height=size,
            width=size,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            max_sequence_length=args.max_sequence_length,
            generator=torch.Generator("cpu").manual_seed(args.seed),
            output_type="pil",
            callback_on_step_end=on_step_end,
        ).images[0]
        if len(starts) != len(ends) or len(ends) != args.steps:
            raise RuntimeError(f"step timing hooks saw {len(starts)} starts / {len(ends)} ends for {args.steps} steps")
        return image, [e - s for s, e in zip(starts, ends, strict=True)]

    return load, generate


def worker(args: argparse.Namespace, engine: str, size: int) -> None:
    # Shared dependencies are imported before the clock starts; each engine's own imports (and the
    # libraries only it pulls in) count towards its load time: a cold start, as a user sees it.
    import numpy as np
    import torch
    from PIL import Image

    runner = {"diffserve": _run_diffserve, "diffusers": _run_diffusers}[engine]
    load, generate = runner(args, size)

    generate()  # warm-up, not counted
    e2e: list[float] = []
    step_times: list[list[float]] = []
    images = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        image, steps = generate()
        e2e.append(time.perf_counter() - start)
        step_times.append(steps)
        images.append(np.asarray(image.convert("RGB")))
    Image.fromarray(images[0]).save(args.image_out)  # lossless PNG: the parent computes PSNR from it
    flat = [t for run in step_times for t in run]
    result = {
        "engine": engine,
        "resolution": size,
        "load_s": load["import_s"] + load["from_pretrained_s"],
        "import_s": load["import_s"],
        "from_pretrained_s": load["from_pretrained_s"],
        "e2e_s": e2e,
        "step_times_s": step_times,
        "s_per_step": statistics.fmean(flat),
        "e2e_mean_s": statistics.fmean(e2e),
        "peak_rss_mb": _peak_rss_mb(),
        "repeats_identical": all(np.array_equal(images[0], im) for im in images[1:]),
        "image_std": float(images[0].std()),
        "torch_threads": torch.get_num_threads(),
        "image": str(args.image_out),
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------- parent


def machine_info() -> dict:
    import diffusers
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }


def dit_parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted((model_dir / "transformer").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def prepare_checkpoint(model_dir: Path) -> None:
    if (model_dir / "model_index.json").exists():
        print(f"Reusing checkpoint at {model_dir}", file=sys.stderr)
        return
    from diffserve.testing.tiny_flux import build_tiny_flux

    print(f"Building checkpoint at {model_dir} ...", file=sys.stderr)
    start = time.perf_counter()
    build_tiny_flux(model_dir, checkpoint_spec())
    print(f"  built in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def run_worker(args: argparse.Namespace, engine: str, size: int, image_out: Path) -> dict:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", engine, str(size),
        "--model-dir", str(args.model_dir), "--steps", str(args.steps), "--repeats", str(args.repeats),
        "--seed", str(args.seed), "--prompt", args.prompt, "--guidance-scale", str(args.guidance_scale),
        "--max-sequence-length", str(args.max_sequence_length), "--image-out", str(image_out),
    ]
    print(f"  {engine:9s} {size}x{size} ...", end="", flush=True, file=sys.stderr)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"worker {engine} {size} failed with exit code {proc.returncode}")
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr)
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    # The worker itself keeps ~torch_threads cores busy; a higher load means other processes competed.
    result["loadavg_1m"] = [load_before, os.getloadavg()[0]]
    return result


def merge_rounds(results: list[dict]) -> dict:
    """Pool the timed generations of several worker processes of one engine and resolution."""
    step_times = [run for r in results for run in r["step_times_s"]]
    e2e = [t for r in results for t in r["e2e_s"]]
    return {
        "engine": results[0]["engine"],
        "resolution": results[0]["resolution"],
        "load_s": statistics.fmean(r["load_s"] for r in results),
        "import_s": statistics.fmean(r["import_s"] for r in results),
        "from_pretrained_s": statistics.fmean(r["from_pretrained_s"] for r in results),
        "s_per_step": statistics.fmean(t for run in step_times for t in run),
        "e2e_mean_s": statistics.fmean(e2e),
        "e2e_s": e2e,
        "step_times_s": step_times,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "repeats_identical": all(r["repeats_identical"] for r in results),
        "image_std": results[0]["image_std"],
        "image": results[0]["image"],
        "workers": len(results),
        "loadavg_1m": [x for r in results for x in r["loadavg_1m"]],
    }


def render(info: dict, dit_params: int, args: argparse.Namespace, rows: dict, parity: dict) -> str:
    out = [
        "# diffserve vs diffusers FluxPipeline",
        "",
        f"- machine: {info['cpu']}, {info['cores']} cores, torch threads {info['torch_threads']}",
        f"- python {info['python']}, torch {info['torch']}, diffusers {info['diffusers']}, "
        f"transformers {info['transformers']}",
        f"- checkpoint: FLUX.1 layout, DiT {dit_params:,} parameters (2 double + 4 single blocks, 8x64 heads), "
        f"T5 length {args.max_sequence_length}, VAE (32, 64, 128, 128)",
        f"- fp32, CPU, {args.steps} steps, guidance {args.guidance_scale}, seed {args.seed}, "
        f"{args.repeats} timed runs per worker after 1 warm-up, {args.rounds} worker(s) per engine and resolution",
        "",
        "| resolution | engine | load s | s/step | end-to-end s | peak RSS MB | PSNR dB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for size in args.sizes:
        ours, ref = rows[size]["diffserve"], rows[size]["diffusers"]
        res = f"{size}x{size}"
        for r in (ours, ref):
            out.append(
                f"| {res} | {r['engine']} | {r['load_s']:.2f} | {r['s_per_step']:.3f} | {r['e2e_mean_s']:.2f} "
                f"| {r['peak_rss_mb']:.0f} | |"
            )
        value = parity[size]
        psnr_cell = "inf (identical)" if value == float("inf") else f"{value:.1f}"
        if value < PSNR_BAR_DB:
            psnr_cell += " BELOW BAR"
        out.append(
            f"| {res} | **diffusers/diffserve** | {ref['load_s'] / ours['load_s']:.2f}x "
            f"| **{ref['s_per_step'] / ours['s_per_step']:.2f}x** | **{ref['e2e_mean_s'] / ours['e2e_mean_s']:.2f}x** "
            f"| {ref['peak_rss_mb'] / ours['peak_rss_mb']:.2f}x | {psnr_cell} |"
        )
        for r in (ours, ref):
            runs = ", ".join(f"{t:.2f}" for t in r["e2e_s"])
            steps = ", ".join(f"{t:.3f}" for run in r["step_times_s"] for t in run)
            notes.append(
                f"- {res} {r['engine']}: load = import {r['import_s']:.2f} s + from_pretrained "
                f"{r['from_pretrained_s']:.2f} s; end-to-end s per run [{runs}]; s per step [{steps}]"
            )
            loads = ", ".join(f"{x:.1f}" for x in r["loadavg_1m"])
            notes.append(f"  - 1-min load average before/after its worker: {loads}")
            if not r["repeats_identical"]:
                notes.append(f"  - WARNING: {r['engine']} produced different images across repeats with one seed")
            if r["image_std"] <= 5:
                notes.append(f"  - WARNING: {r['engine']} image is nearly flat; the PSNR comparison proves little")
    contended = [
        f"{r['resolution']}x{r['resolution']} {r['engine']} (1-min load up to {max(r['loadavg_1m']):.1f})"
        for size in args.sizes
        for r in rows[size].values()
        if max(r["loadavg_1m"]) > info["torch_threads"] + CONTENTION_MARGIN
    ]
    if contended:
        out += [
            "",
            f"**WARNING: CPU contention** (load above {info['torch_threads']} torch threads + "
            f"{CONTENTION_MARGIN:g}) during: {'; '.join(contended)}. These timings and ratios are unreliable; "
            "rerun on an idle machine.",
        ]
    out += [
        "",
        "Ratios are diffusers / diffserve: >1 means diffserve is faster (load, s/step, end-to-end) or smaller "
        f"(RSS). PSNR compares the two engines' images for the same seed (bar: {PSNR_BAR_DB:.0f} dB). "
        "Load is a cold start in a fresh process with torch already imported: the engine's imports plus "
        "from_pretrained. A load average well above the torch thread count means other processes "
        "competed for the CPU during that measurement; rerun on an idle machine (or with --rounds 2+).",
        "",
        "Raw timings:",
        *notes,
    ]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="checkpoint folder to reuse (built there if missing); default: a temporary folder")
    p.add_argument("--resolutions", default="256,512", help="comma-separated square sizes (default: 256,512)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per generation (default: 4)")
    p.add_argument("--repeats", type=int, default=2, help="timed generations per worker, after 1 warm-up (default: 2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="worker processes per engine and resolution, alternating engines; results pooled (default: 1)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--prompt", default="a red fox in the snow, golden hour, highly detailed")
    p.add_argument("--guidance-scale", type=float, default=3.5)
    p.add_argument("--max-sequence-length", type=int, default=512)
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
    p.add_argument("--image-dir", type=Path, default=None, help="keep the compared images here")
    p.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds before a worker is killed")
    p.add_argument("--worker", nargs=2, metavar=("ENGINE", "RES"), help=argparse.SUPPRESS)
    p.add_argument("--image-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.resolutions.split(",") if s.strip()]
    if args.steps < 1 or args.repeats < 1 or args.rounds < 1:
        p.error("--steps, --repeats and --rounds must be >= 1")
    for size in args.sizes:
        if size <= 0 or size % 16:
            p.error(f"resolution {size} must be a positive multiple of 16")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        engine, size = args.worker
        if engine not in ENGINES:
            raise SystemExit(f"unknown engine {engine!r}")
        worker(args, engine, int(size))
        return

    with tempfile.TemporaryDirectory(prefix="diffserve-bench-") as tmp:
        args.model_dir = (args.model_dir or Path(tmp) / "flux").resolve()
        image_dir = (args.image_dir or Path(tmp) / "images").resolve()
        image_dir.mkdir(parents=True, exist_ok=True)
        prepare_checkpoint(args.model_dir)
        info = machine_info()
        dit_params = dit_parameter_count(args.model_dir)
        print(f"DiT parameters: {dit_params:,}", file=sys.stderr)

        import numpy as np
        from PIL import Image

        rows: dict[int, dict[str, dict]] = {}
        parity: dict[int, float] = {}
        for size in args.sizes:
            per_engine: dict[str, list[dict]] = {e: [] for e in ENGINES}
            for round_ in range(args.rounds):
                for engine in ENGINES:
                    image_out = image_dir / f"{engine}_{size}_r{round_}.png"
                    per_engine[engine].append(run_worker(args, engine, size, image_out))
            rows[size] = {e: merge_rounds(per_engine[e]) for e in ENGINES}
            ours = np.asarray(Image.open(rows[size]["diffserve"]["image"]).convert("RGB"))
            ref = np.asarray(Image.open(rows[size]["diffusers"]["image"]).convert("RGB"))
            parity[size] = psnr(ours, ref)

        print(render(info, dit_params, args, rows, parity))
        if args.json:
            payload = {
                "machine": info,
                "dit_parameters": dit_params,
                "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "image_out", "json")},
                "results": {str(s): rows[s] for s in args.sizes},
                "psnr_db": {str(s): parity[s] for s in args.sizes},
            }
            args.json.write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    main()
