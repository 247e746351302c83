"""Issue 8's FLUX bars timed in one process, engines alternating, each bar as paired per-round ratios.

`bench_speed.py` runs every engine in fresh processes. On a shared 2-core VM the speed of a whole
process drifts (the same engine's processes differ by 5-50% in one run, and a slow phase can last
minutes), so per-process medians carry that drift into every ratio. This script loads all of
`bench_speed.py`'s engines (the same `RUNNERS`: `DiffGenerator.from_pretrained(path, compile=...)`,
`FluxPipeline` eager, with `compile_repeated_blocks()` and with `torch.compile(transformer)`) into one
process per checkpoint and resolution, runs one untimed warm-up generation each (diffusers compiles
there; diffserve compiled in `from_pretrained`), shuts inductor's compile workers down, then runs
`--rounds` rounds: in each round every engine generates once, in an order rotated every round. A
bar's ratio is computed per round from that round's s/step (the median of its denoising steps), i.e.
from engines timed seconds apart, and reported as the median over rounds with its range.

What it does not measure: load time, first-call time and peak RSS (shared by the engines here; use
`bench_speed.py`), and image agreement (`bench_speed.py` reports PSNR per engine).

    .venv/bin/python benchmarks/bench_speed_ab.py --model-dir /tmp/bench_speed --rounds 10
    .venv/bin/python benchmarks/bench_speed_ab.py --sizes 36m --resolutions 256 --steps 2 --rounds 2   # smoke
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_speed
import harness
import roofline


def _round_robin(engines: list[str], round_: int) -> list[str]:
    shift = round_ % len(engines)
    return engines[shift:] + engines[:shift]


def time_resolution(args: argparse.Namespace, size: int) -> dict[str, list[float]]:
    """Per engine, the s/step of each round (median over that generation's denoising steps)."""
    generators = {}
    for engine in args.engines:
        print(f"  {args.checkpoint} {size}x{size}: loading {engine} ...", file=sys.stderr, flush=True)
        _load, generate = bench_speed.RUNNERS[engine](args, size)
        generate()  # warm-up: diffusers' torch.compile compiles here
        generators[engine] = generate
    harness.stop_compile_workers()
    per_round: dict[str, list[float]] = {engine: [] for engine in args.engines}
    for round_ in range(args.rounds):
        for engine in _round_robin(args.engines, round_):
            _image, step_times = generators[engine]()
            per_round[engine].append(statistics.median(step_times))
        print(f"  round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    del generators
    gc.collect()
    return per_round


def bar_ratios(per_round: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Each bar of `bench_speed.BARS` as paired per-round ratios (numerator time / denominator time)."""
    bars = []
    for title, numerators, denominator, bar in bench_speed.BARS:
        present = [e for e in numerators if e in per_round]
        if not present or denominator not in per_round:
            continue
        # Several numerator engines (diffusers' two compile modes): the faster one over the whole run.
        reference = min(present, key=lambda e: statistics.median(per_round[e]))
        ratios = [n / d for n, d in zip(per_round[reference], per_round[denominator], strict=True)]
        bars.append({
            "title": title, "reference": reference, "denominator": denominator, "bar": bar,
            "ratios": ratios, "median": statistics.median(ratios),
        })  # fmt: skip
    return bars


def render(info: dict, args: argparse.Namespace, results: dict[str, dict[str, dict]]) -> str:
    out = [
        "# FLUX bars, one process per checkpoint and resolution, engines alternating",
        "",
        *harness.machine_lines(info),
        f"- fp32, CPU, {args.steps} steps, guidance {args.guidance_scale} (embedded), T5 length "
        f"{args.max_sequence_length}, {args.rounds} rounds after one warm-up generation per engine",
        "",
        "## s/step per engine (median over rounds; range)",
        "",
        "| checkpoint | resolution | " + " | ".join(args.engines) + " |",
        "|---|---|" + "---:|" * len(args.engines),
    ]
    for checkpoint, per_size in results.items():
        for size, res in per_size.items():
            cells = [
                f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})"
                for t in (res["s_per_step"][e] for e in args.engines)
            ]
            out.append(f"| {checkpoint} | {size}x{size} | " + " | ".join(cells) + " |")
    out += [
        "",
        "## Bars: paired per-round ratios (>1 means diffserve is faster)",
        "",
        "| checkpoint | resolution | bar | median ratio | range over rounds | rounds at or above the bar |",
        "|---|---|---|---:|---:|---:|",
    ]
    for checkpoint, per_size in results.items():
        for size, res in per_size.items():
            for b in res["bars"]:
                which = f" ({b['reference']})" if b["reference"].startswith("diffusers-compiled") else ""
                verdict = "PASS" if b["median"] >= b["bar"] else "MISS"
                above = sum(r >= b["bar"] for r in b["ratios"])
                out.append(
                    f"| {checkpoint} | {size}x{size} | {b['title']}{which} (bar {b['bar']:g}x) "
                    f"| **{b['median']:.2f}x** {verdict} | {min(b['ratios']):.2f}-{max(b['ratios']):.2f}x "
                    f"| {above}/{len(b['ratios'])} |"
                )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_run_args(
        p, "256,512", "parent folder of the checkpoints (one sub-folder per size, built there if missing); "
        "default: a temporary folder",
    )  # fmt: skip
    p.add_argument("--sizes", dest="checkpoint_sizes", default="36m,140m", help="comma-separated: 36m, 140m")
    p.add_argument(
        "--engines", default=",".join(bench_speed.ENGINES), help=f"subset of {', '.join(bench_speed.ENGINES)}"
    )
    p.add_argument("--guidance-scale", type=float, default=3.5)
    p.add_argument("--max-sequence-length", type=int, default=512)
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
    p.set_defaults(rounds=10)  # here: rounds in the one process, every engine once per round
    args = p.parse_args(argv)
    harness.check_run_args(p, args, size_multiple=roofline.PIXELS_PER_TOKEN_SIDE)
    args.checkpoints = [s.strip() for s in args.checkpoint_sizes.split(",") if s.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for name in args.checkpoints:
        if name not in roofline.CHECKPOINT_SPECS:
            p.error(f"unknown size {name!r}; choose from {', '.join(roofline.CHECKPOINT_SPECS)}")
    for engine in args.engines:
        if engine not in bench_speed.RUNNERS:
            p.error(f"unknown engine {engine!r}; choose from {', '.join(bench_speed.ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = harness.machine_info()
    results: dict[str, dict[str, dict]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffserve-bench-speed-ab-") as tmp:
        parent = (args.model_dir or Path(tmp)).resolve()
        for name in args.checkpoints:
            model_dir = parent / f"flux_{name}"
            roofline.prepare_checkpoint(model_dir, name)
            args.model_dir, args.checkpoint = model_dir, name  # what bench_speed.RUNNERS read
            results[name] = {}
            for size in args.sizes:
                per_round = time_resolution(args, size)
                results[name][str(size)] = {"s_per_step": per_round, "bars": bar_ratios(per_round)}
            args.model_dir = parent
    print(render(info, args, results))
    print(f"\n(total {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.json:
        harness.write_json(args.json, {"machine": info, "settings": harness.settings_for_json(args), "results": results})


if __name__ == "__main__":
    main()
