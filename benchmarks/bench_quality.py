"""Quality tiers on one engine: end-to-end time and PSNR of `medium`, `low`, `draft` against `high` (exact).

The tier is a per-request field, so the honest comparison is one loaded engine serving the same
prompts at each tier: this script loads the FLUX-architecture benchmark checkpoint (~36M DiT, T5 length
512; `bench_flux_vs_diffusers.py`'s, built on first use) once, optionally calibrates it first
(`--calibrate`: the same search as `diffserve calibrate-cache`, written next to the checkpoint), then runs
`--rounds` rounds; each round generates every calibration prompt at every tier, tiers alternating, so
machine noise hits all tiers alike. Reported per tier: mean end-to-end seconds, speed-up against
the exact tier `high` (mean of per-prompt ratios), steps computed in full, mean and min PSNR against it.

    .venv/bin/python benchmarks/bench_quality.py --calibrate                  # 256x256, 28 steps
    .venv/bin/python benchmarks/bench_quality.py --resolution 512 --steps 20 --rounds 1
    .venv/bin/python benchmarks/bench_quality.py --demo --calibrate           # the trained demo model

Random weights make a poor judge of an approximation: their images barely depend on the DiT's
prediction, so every tier scores ~50 dB. `--demo` runs the shipped demo model instead (trained, FLUX.1
architecture, 64x64, 20 steps, true CFG; copied to `--model-dir` so the calibration file never lands in
the installed package) on prompts from its vocabulary: there the PSNR means something.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flux_vs_diffusers as flux_bench  # noqa: E402
import harness  # noqa: E402
from diffserve.configs.quality import EXACT, TIERS  # noqa: E402

DEMO_PROMPTS = (
    "a large red circle in the center on a black background",
    "a small blue square at the top left on a white background",
    "a large yellow triangle at the bottom right on a gray background",
    "a small magenta circle at the top right on a black background",
    "a large cyan square at the bottom left on a white background",
    "a small green triangle in the center on a gray background",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-dir",
        type=Path,
        default=Path("/tmp/diffserve-bench/flux-36m"),
        help="FLUX checkpoint (built with the 36M spec when missing)",
    )
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--steps", type=int, default=28, help="denoising steps (FLUX.1-dev's default: 28)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--guidance-scale", type=float, default=3.5)
    p.add_argument("--calibrate", action="store_true", help="run the calibration search first and store it")
    p.add_argument(
        "--demo",
        action="store_true",
        help="the trained demo model (copied to --model-dir), its prompts, 64x64, 20 steps",
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def calibrate(args: argparse.Namespace, prompts: tuple[str, ...]) -> None:
    from diffserve.cli.main import main as cli

    prompt_flags = [flag for prompt in prompts for flag in ("--prompt", prompt)]
    code = cli(
        [
            "calibrate-cache",
            "--model-path",
            str(args.model_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--height",
            str(args.resolution),
            "--width",
            str(args.resolution),
            "--num-inference-steps",
            str(args.steps),
            "--log-level",
            "warning",
            *prompt_flags,
        ]
    )
    if code:
        raise SystemExit(f"calibration failed with exit code {code}")


def prepare_demo(args: argparse.Namespace) -> None:
    """Copy the shipped demo model to --model-dir (once) and use its size and step count."""
    import shutil

    from diffserve.configs.demo_model import model_path_or_demo

    if not (args.model_dir / "model_index.json").exists():
        shutil.copytree(model_path_or_demo(None), args.model_dir)
    args.resolution, args.steps = 64, 20


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffserve.cli.calibrate_cache import DEFAULT_PROMPTS

    prompts = DEFAULT_PROMPTS
    if args.demo:
        prepare_demo(args)
        prompts = DEMO_PROMPTS
    else:
        flux_bench.prepare_checkpoint(args.model_dir)
    if args.calibrate:
        calibrate(args, prompts)
    from diffserve.api import DiffGenerator
    from diffserve.configs.quality import describe_preset
    from diffserve.testing.image_metrics import psnr_uint8

    generator = DiffGenerator.from_pretrained(
        args.model_dir, device="cpu", dtype="float32", show_progress=False
    )
    request = {
        "height": args.resolution,
        "width": args.resolution,
        "num_inference_steps": args.steps,
        "seed": 0,
        "guidance_scale": None if args.demo else args.guidance_scale,
    }
    # Warm-up, untimed: first calls allocate, and every prompt's text embedding lands in the prompt
    # cache, so no tier pays the text encoders while another gets a cache hit.
    for prompt in prompts:
        generator.generate(prompt, **{**request, "num_inference_steps": 1})
    seconds: dict[str, dict[str, list[float]]] = {t: {p: [] for p in prompts} for t in TIERS}
    images: dict[str, dict[str, np.ndarray]] = {t: {} for t in TIERS}
    steps: dict[str, dict[str, int]] = {t: {} for t in TIERS}
    for round_index in range(args.rounds):
        for prompt in prompts:
            order = TIERS if round_index % 2 == 0 else tuple(reversed(TIERS))
            for tier in order:
                start = time.perf_counter()
                out = generator.generate(prompt, quality=tier, **request)
                seconds[tier][prompt].append(time.perf_counter() - start)
                images[tier][prompt] = np.asarray(out.images[0].convert("RGB"))
                steps[tier][prompt] = out.steps_computed_in_full
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)

    rows = {}
    for tier in TIERS:
        per_prompt = {p: statistics.median(v) for p, v in seconds[tier].items()}
        ratios = [statistics.median(seconds[EXACT][p]) / per_prompt[p] for p in prompts]
        psnrs = [psnr_uint8(images[tier][p], images[EXACT][p]) for p in prompts]
        rows[tier] = {
            "seconds": statistics.mean(per_prompt.values()),
            "speedup": statistics.mean(ratios),
            "steps_computed": statistics.mean(steps[tier].values()),
            "mean_psnr_db": statistics.mean(psnrs) if tier != EXACT else float("inf"),
            "min_psnr_db": min(psnrs) if tier != EXACT else float("inf"),
            "preset": None
            if tier == EXACT
            else describe_preset(generator.pipeline.quality_rule.policies[tier]),
        }
    info = harness.machine_info()
    lines = [
        f"{'trained demo model' if args.demo else 'random-weight'} FLUX-architecture checkpoint ({harness.dit_parameter_count(args.model_dir) / 1e6:.1f}M DiT), "
        f"{args.resolution}x{args.resolution}, {args.steps} steps, {len(prompts)} prompts x {args.rounds} "
        f"rounds, {info['cpu']} ({info['cores']} cores), torch {info['torch']}, fp32",
        "",
        "| quality | preset | end-to-end s | speed-up vs high (exact) | steps in full | mean PSNR | min PSNR |",
        "|---|---|---|---|---|---|---|",
    ]
    for tier, r in rows.items():
        psnr = "exact" if tier == EXACT else f"{r['mean_psnr_db']:.1f} dB"
        low = "exact" if tier == EXACT else f"{r['min_psnr_db']:.1f} dB"
        preset = "-" if r["preset"] is None else r["preset"]
        lines.append(
            f"| {tier} | {preset} | {r['seconds']:.2f} | {r['speedup']:.2f}x | "
            f"{r['steps_computed']:.1f} / {args.steps} | {psnr} | {low} |"
        )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "settings": vars(args) | {"model_dir": str(args.model_dir), "json": str(args.json)},
                    "tiers": rows,
                },
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
