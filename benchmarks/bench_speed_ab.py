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
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import alternating
import bench_speed
import harness
import roofline


def measure(args: argparse.Namespace, size: int) -> dict[str, Any]:
    """All engines at one checkpoint and resolution: per-round times and each bar's paired ratios."""
    loaders = {
        engine: (lambda engine=engine: bench_speed.RUNNERS[engine](args, size)[1]) for engine in args.engines
    }
    times = alternating.time_alternating(loaders, args.rounds, f"{args.checkpoint} {size}x{size}")
    bars = []
    for title, numerators, denominator, bar in bench_speed.BARS:
        present = [e for e in numerators if e in times]
        if not present or denominator not in times:
            continue
        # Several numerator engines (diffusers' two compile modes): the faster one over the whole run.
        reference = min(present, key=lambda e: statistics.median(times[e].s_per_step))
        bars.append((title, bar, alternating.paired(times, reference, denominator)))
    return {"times": times, "bars": bars}


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
            cells = [alternating.median_cell(res["times"][e].s_per_step) for e in args.engines]
            out.append(f"| {checkpoint} | {size}x{size} | " + " | ".join(cells) + " |")
    out += [
        "",
        "## Bars: paired per-round s/step ratios (>1 means diffserve is faster)",
        "",
        "| checkpoint | resolution | bar | median ratio (range over rounds), verdict, rounds at the bar |",
        "|---|---|---|---:|",
    ]
    for checkpoint, per_size in results.items():
        for size, res in per_size.items():
            for title, bar, ratio in res["bars"]:
                which = f" ({ratio.numerator})" if ratio.numerator.startswith("diffusers-compiled") else ""
                out.append(
                    f"| {checkpoint} | {size}x{size} | {title}{which} (bar {bar:g}x) | {ratio.cell(bar)} |"
                )
    return "\n".join(out)


def to_json(results: dict[str, dict[str, dict]]) -> dict:
    return {
        checkpoint: {
            size: {
                "s_per_step": {e: t.s_per_step for e, t in res["times"].items()},
                "end_to_end_s": {e: t.end_to_end_s for e, t in res["times"].items()},
                "bars": [
                    {"title": title, "bar": bar, "reference": r.numerator, "ratios": list(r.per_round)}
                    for title, bar, r in res["bars"]
                ],
            }
            for size, res in per_size.items()
        }
        for checkpoint, per_size in results.items()
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_speed.add_selection_args(p, rounds=(10, "rounds in the one process, every engine once per round"))
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    harness.check_run_args(p, args, size_multiple=roofline.PIXELS_PER_TOKEN_SIDE)
    bench_speed.check_selection(p, args)
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
                results[name][str(size)] = measure(args, size)
            args.model_dir = parent
    print(render(info, args, results))
    print(f"\n(total {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.json:
        payload = {"machine": info, "settings": harness.settings_for_json(args), "results": to_json(results)}
        harness.write_json(args.json, payload)


if __name__ == "__main__":
    main()
