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
import os
import sys
import tempfile
import time
from pathlib import Path

import harness


def checkpoint_spec():
    """The benchmark checkpoint: FLUX block shapes at reduced depth; small text encoders."""
    from diffserve.families.flux.tiny import TinyFluxSpec

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


def _run_diffserve(args: argparse.Namespace, size: int):
    start = time.perf_counter()
    from diffserve.api import DiffGenerator

    imported = time.perf_counter()
    generator = DiffGenerator.from_pretrained(
        args.model_dir, device="cpu", dtype="float32", show_progress=False
    )
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
    timer = harness.DiffusersStepTimer(pipe.transformer)

    def generate():
        timer.reset()
        image = pipe(
            prompt=args.prompt,
            height=size,
            width=size,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            max_sequence_length=args.max_sequence_length,
            generator=torch.Generator("cpu").manual_seed(args.seed),
            output_type="pil",
            callback_on_step_end=timer.on_step_end,
        ).images[0]
        return image, timer.step_times(args.steps)

    return load, generate


def worker(args: argparse.Namespace, engine: str, size: int) -> None:
    # Shared dependencies are imported before the clock starts; each engine's own imports (and the
    # libraries only it pulls in) count towards its load time: a cold start, as a user sees it.
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401

    runner = {"diffserve": _run_diffserve, "diffusers": _run_diffusers}[engine]
    load, generate = runner(args, size)
    harness.run_timed_generations(engine, size, load, generate, args.repeats, args.image_out)


# --------------------------------------------------------------------------------------------- parent


def prepare_checkpoint(model_dir: Path) -> None:
    if (model_dir / "model_index.json").exists():
        print(f"Reusing checkpoint at {model_dir}", file=sys.stderr)
        return
    from diffserve.families.flux.tiny import build_tiny_flux

    print(f"Building checkpoint at {model_dir} ...", file=sys.stderr)
    start = time.perf_counter()
    build_tiny_flux(model_dir, checkpoint_spec())
    print(f"  built in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def worker_command(args: argparse.Namespace, engine: str, size: int, image_out: Path) -> list[str]:
    return [
        sys.executable, os.path.abspath(__file__), "--worker", engine, str(size),
        "--model-dir", str(args.model_dir), "--steps", str(args.steps), "--repeats", str(args.repeats),
        "--seed", str(args.seed), "--prompt", args.prompt, "--guidance-scale", str(args.guidance_scale),
        "--max-sequence-length", str(args.max_sequence_length), "--image-out", str(image_out),
    ]  # fmt: skip


def render(info: dict, dit_params: int, args: argparse.Namespace, rows: dict, parity: dict) -> str:
    table, notes = harness.results_table(args.sizes, rows, parity)
    out = [
        "# diffserve vs diffusers FluxPipeline",
        "",
        *harness.machine_lines(info),
        f"- checkpoint: FLUX.1 layout, DiT {dit_params:,} parameters (2 double + 4 single blocks, 8x64 heads), "
        f"T5 length {args.max_sequence_length}, VAE (32, 64, 128, 128)",
        f"- fp32, CPU, {args.steps} steps, guidance {args.guidance_scale}, seed {args.seed}, "
        f"{args.repeats} timed runs per worker after 1 warm-up, {args.rounds} worker(s) per engine and resolution",
        "",
        *table,
        *harness.contention_lines(args.sizes, rows, info["torch_threads"]),
        "",
        harness.legend(),
        "",
        "Raw timings:",
        *notes,
    ]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_run_args(
        p, "256,512", "checkpoint folder to reuse (built there if missing); default: a temporary folder"
    )
    p.add_argument("--guidance-scale", type=float, default=3.5)
    p.add_argument("--max-sequence-length", type=int, default=512)
    harness.add_output_args(p)
    args = p.parse_args(argv)
    harness.check_run_args(p, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        engine, size = harness.parse_worker(args)
        worker(args, engine, size)
        return

    with tempfile.TemporaryDirectory(prefix="diffserve-bench-") as tmp:
        args.model_dir = (args.model_dir or Path(tmp) / "flux").resolve()
        image_dir = (args.image_dir or Path(tmp) / "images").resolve()
        image_dir.mkdir(parents=True, exist_ok=True)
        prepare_checkpoint(args.model_dir)
        info = harness.machine_info()
        dit_params = harness.dit_parameter_count(args.model_dir)
        print(f"DiT parameters: {dit_params:,}", file=sys.stderr)

        rows, parity = harness.compare_engines(
            args.sizes,
            args.rounds,
            lambda engine, size, image_out: worker_command(args, engine, size, image_out),
            image_dir,
            args.worker_timeout,
        )

        print(render(info, dit_params, args, rows, parity))
        if args.json:
            payload = {
                "machine": info,
                "dit_parameters": dit_params,
                "settings": harness.settings_for_json(args),
                "results": {str(s): rows[s] for s in args.sizes},
                "psnr_db": {str(s): parity[s] for s in args.sizes},
            }
            harness.write_json(args.json, payload)


if __name__ == "__main__":
    main()
