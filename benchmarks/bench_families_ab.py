"""Every family against its diffusers pipeline, eager and compiled, in one process, engines alternating.

`bench_families.py --compile` runs each engine in fresh processes and so also reports load time, time
to a first image and peak RSS; its s/step ratios swing with the shared VM's per-process drift
(`alternating.py`). This script loads the same five engines per family (`bench_families.RUNNERS`:
diffserve eager, `compile=True`, diffusers eager, diffusers compiled with `compile_repeated_blocks()`
where its DiT declares repeated blocks, else `torch.compile(transformer)`, and diffusers with its whole
transformer `torch.compile`d) into one process (`--engines`: a subset), warms each up once, and runs
`--rounds` rounds of one generation per engine, rotating the order. Each ratio (diffusers time /
diffserve time, > 1: diffserve faster) is taken per round, then the median over rounds with its range,
for s/step and end to end. `--quick`: 2 steps, 2 rounds, issue 37's families unless `--family` is given.

    .venv/bin/python benchmarks/bench_families_ab.py --model-dir /tmp/bench_families --rounds 10
    .venv/bin/python benchmarks/bench_families_ab.py --family qwen-image --resolutions 256,512 \
        --engines diffserve,diffserve-compiled,diffusers,diffusers-compiled-full --rounds 6
    .venv/bin/python benchmarks/bench_families_ab.py --quick --model-dir /tmp/bench_families
    .venv/bin/python benchmarks/bench_families_ab.py --family z-image --resolutions 64 --steps 1 --rounds 2  # smoke
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import alternating
import bench_families
import harness

ENGINES = bench_families.COMPILE_ENGINES
#: (label, diffusers engine, diffserve engine): ratio = diffusers time / diffserve time.
RATIOS = (
    ("eager vs eager", "diffusers", "diffserve"),
    ("diffserve compiled vs diffusers eager", "diffusers", "diffserve-compiled"),
    ("compiled vs compiled", "diffusers-compiled", "diffserve-compiled"),
    ("compiled vs diffusers whole-transformer compile", "diffusers-compiled-full", "diffserve-compiled"),
)


def measure(
    args: argparse.Namespace, family: bench_families.Family, size: int
) -> dict[str, alternating.RoundTimes]:
    loaders = {
        engine: (lambda engine=engine: bench_families.RUNNERS[engine](args, family, size)[1])
        for engine in args.engines
    }
    return alternating.time_alternating(loaders, args.rounds, f"{family.name} {size}")


def render(info: dict, args: argparse.Namespace, results: dict[str, dict[int, dict]]) -> str:
    out = [
        "# Every family vs diffusers, one process per family, engines alternating",
        "",
        *harness.machine_lines(info),
        f"- fp32, CPU, {args.steps} steps, {args.rounds} rounds after one warm-up generation per engine; "
        f"Wan: {args.num_frames} frames",
        "",
        "## s/step per engine (median over rounds; range)",
        "",
        "| family | size | " + " | ".join(args.engines) + " |",
        "|---|---|" + "---:|" * len(args.engines),
    ]
    ratios = [r for r in RATIOS if r[1] in args.engines and r[2] in args.engines]
    for name, per_size in results.items():
        for size, times in per_size.items():
            cells = [alternating.median_cell(times[e].s_per_step) for e in args.engines]
            out.append(f"| {name} | {size} | " + " | ".join(cells) + " |")
    for metric, title in (("s_per_step", "s/step"), ("end_to_end_s", "end to end")):
        out += [
            "",
            f"## Paired per-round ratios, {title} (diffusers / diffserve; > 1: diffserve faster)",
            "",
            "| family | size | " + " | ".join(label for label, _d, _o in ratios) + " |",
            "|---|---|" + "---:|" * len(ratios),
        ]
        for name, per_size in results.items():
            for size, times in per_size.items():
                cells = [alternating.paired(times, ref, ours, metric).cell() for _label, ref, ours in ratios]
                out.append(f"| {name} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--family", default="all", help=f"comma-separated out of {', '.join(bench_families.FAMILIES)}"
    )
    p.add_argument(
        "--model-dir", type=Path, default=None, help="checkpoints, one folder per family (built if missing)"
    )
    p.add_argument("--resolutions", default=None, help="comma-separated sizes (default: each family's own)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10, help="rounds, every engine once per round (default: 10)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--prompt", default="a red fox in the snow, golden hour, highly detailed")
    p.add_argument("--num-frames", type=int, default=bench_families.DEFAULT_NUM_FRAMES)
    p.add_argument("--edit-condition-area", type=int, default=bench_families.DEFAULT_EDIT_CONDITION_AREA)
    p.add_argument("--kontext-auto-resize", action="store_true", help="flux-kontext: see bench_families.py")
    p.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}"
    )
    p.add_argument("--quick", action="store_true", help="2 steps, 2 rounds; issue 37's families by default")
    p.add_argument("--json", type=Path, default=None)
    family_given = any(a == "--family" or a.startswith("--family=") for a in (argv or sys.argv[1:]))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 2, 2
        if not family_given:
            args.family = ",".join(bench_families.QUICK_FAMILIES)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engines or any(e not in ENGINES for e in args.engines):
        p.error(f"--engines: choose from {', '.join(ENGINES)}")
    args.resolutions_given = args.resolutions is not None
    args.sizes = [int(s) for s in (args.resolutions or "0").split(",") if s.strip()]
    names = list(bench_families.FAMILIES) if args.family == "all" else args.family.split(",")
    unknown = [n for n in names if n not in bench_families.FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(bench_families.FAMILIES)}")
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    args.families = names
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = harness.machine_info()
    results: dict[str, dict[int, dict]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffserve-bench-families-ab-") as tmp:
        args.model_dir = (args.model_dir or Path(tmp)).resolve()
        for name in args.families:
            family = bench_families.FAMILIES[name]
            bench_families.prepare_checkpoint(family, args.model_dir)
            results[name] = {
                size: measure(args, family, size) for size in bench_families.family_sizes(args, family)
            }
    print(render(info, args, results))
    print(f"\n(total {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.json:
        payload = {
            name: {
                str(size): {
                    e: {"s_per_step": t.s_per_step, "end_to_end_s": t.end_to_end_s} for e, t in times.items()
                }
                for size, times in per_size.items()
            }
            for name, per_size in results.items()
        }
        harness.write_json(args.json, {"machine": info, "results": payload})


if __name__ == "__main__":
    main()
