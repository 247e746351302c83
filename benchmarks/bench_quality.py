"""Quality tiers on one engine: end-to-end time and PSNR of `high`, `medium`, `low` against `lossless`.

The tier is a per-request field, so the honest comparison is one loaded engine serving the same
prompts at each tier: this script loads the FLUX-architecture benchmark checkpoint (~36M DiT, T5 length
512; `bench_flux_vs_diffusers.py`'s, built on first use) once, optionally calibrates it first
(`--calibrate`: the same search as `diffserve calibrate-cache`, written next to the checkpoint), then runs
`--rounds` rounds; each round generates every calibration prompt at every tier, tiers alternating, so
machine noise hits all tiers alike. Reported per tier: mean end-to-end seconds, speed-up against
lossless (mean of per-prompt ratios), steps computed in full, mean and min PSNR against lossless.

    .venv/bin/python benchmarks/bench_quality.py --calibrate                  # 256x256, 28 steps
    .venv/bin/python benchmarks/bench_quality.py --resolution 512 --steps 20 --rounds 1
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

TIERS = ("lossless", "high", "medium", "low")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/diffserve-bench/flux-36m"),
                   help="FLUX checkpoint (built with the 36M spec when missing)")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--steps", type=int, default=28, help="denoising steps (FLUX.1-dev's default: 28)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--guidance-scale", type=float, default=3.5)
    p.add_argument("--calibrate", action="store_true", help="run the calibration search first and store it")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def calibrate(args: argparse.Namespace) -> None:
    from diffserve.cli.main import main as cli

    code = cli(["calibrate-cache", "--model-path", str(args.model_dir), "--device", "cpu", "--dtype", "float32",
                "--height", str(args.resolution), "--width", str(args.resolution),
                "--num-inference-steps", str(args.steps), "--log-level", "warning"])
    if code:
        raise SystemExit(f"calibration failed with exit code {code}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    flux_bench.prepare_checkpoint(args.model_dir)
    if args.calibrate:
        calibrate(args)
    from diffserve.api import DiffGenerator
    from diffserve.cli.calibrate_cache import DEFAULT_PROMPTS
    from diffserve.testing.image_metrics import psnr_uint8

    generator = DiffGenerator.from_pretrained(args.model_dir, device="cpu", dtype="float32", show_progress=False)
    request = {"height": args.resolution, "width": args.resolution, "num_inference_steps": args.steps,
               "guidance_scale": args.guidance_scale, "seed": 0}
    # Warm-up, untimed: first calls allocate, and every prompt's text embedding lands in the prompt
    # cache, so no tier pays the text encoders while another gets a cache hit.
    for prompt in DEFAULT_PROMPTS:
        generator.generate(prompt, **{**request, "num_inference_steps": 1})
    seconds: dict[str, dict[str, list[float]]] = {t: {p: [] for p in DEFAULT_PROMPTS} for t in TIERS}
    images: dict[str, dict[str, np.ndarray]] = {t: {} for t in TIERS}
    steps: dict[str, dict[str, int]] = {t: {} for t in TIERS}
    for round_index in range(args.rounds):
        for prompt in DEFAULT_PROMPTS:
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
        ratios = [statistics.median(seconds["lossless"][p]) / per_prompt[p] for p in DEFAULT_PROMPTS]
        psnrs = [psnr_uint8(images[tier][p], images["lossless"][p]) for p in DEFAULT_PROMPTS]
        rows[tier] = {
            "seconds": statistics.mean(per_prompt.values()),
            "speedup": statistics.mean(ratios),
            "steps_computed": statistics.mean(steps[tier].values()),
            "mean_psnr_db": statistics.mean(psnrs) if tier != "lossless" else float("inf"),
            "min_psnr_db": min(psnrs) if tier != "lossless" else float("inf"),
            "threshold": None if tier == "lossless" else generator.pipeline.quality_rule.policies[tier].threshold,
        }
    info = harness.machine_info()
    lines = [
        f"FLUX-architecture checkpoint ({harness.dit_parameter_count(args.model_dir) / 1e6:.1f}M DiT), "
        f"{args.resolution}x{args.resolution}, {args.steps} steps, {len(DEFAULT_PROMPTS)} prompts x {args.rounds} "
        f"rounds, {info['cpu']} ({info['cores']} cores), torch {info['torch']}, fp32",
        "",
        "| quality | threshold | end-to-end s | speed-up vs lossless | steps in full | mean PSNR | min PSNR |",
        "|---|---|---|---|---|---|---|",
    ]
    for tier, r in rows.items():
        psnr = "exact" if tier == "lossless" else f"{r['mean_psnr_db']:.1f} dB"
        low = "exact" if tier == "lossless" else f"{r['min_psnr_db']:.1f} dB"
        threshold = "-" if r["threshold"] is None else f"{r['threshold']:g}"
        lines.append(f"| {tier} | {threshold} | {r['seconds']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['steps_computed']:.1f} / {args.steps} | {psnr} | {low} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "settings": vars(args) | {"model_dir": str(args.model_dir),
                                         "json": str(args.json)}, "tiers": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
