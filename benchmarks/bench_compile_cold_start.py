"""`--compile` cold start: seconds from `DiffGenerator.from_pretrained(path, compile=True)` to the first
compiled image, each measurement in a fresh process with an empty inductor cache (its own
TORCHINDUCTOR_CACHE_DIR), so the compile itself is timed, not a cache hit. `--warm-cache` times the other
case: every process of a variant shares one cache that an untimed first process filled.

Variants (`--variant NAME=PYTHONPATH`, repeatable; default: this tree as "current") run alternately, one
process each per round, so a slow phase of a shared machine falls on all of them; the report gives the
median per variant and each variant's median ratio to the first one, taken per round. Issue 37 compared
the tree before its change (a `git archive` of the commit, its `src` on PYTHONPATH) with the tree after:

    .venv/bin/python benchmarks/bench_compile_cold_start.py --model-dir /tmp/bench_speed/flux_36m \\
        --variant before=/tmp/base/src --variant after=src --rounds 3
    .venv/bin/python benchmarks/bench_compile_cold_start.py --model-dir /tmp/tiny-flux --rounds 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER_FLAG = "--worker"


def worker(args: argparse.Namespace) -> None:
    """One cold start: import, from_pretrained(compile=True) (compile + warm-up), one generation."""
    start = time.perf_counter()
    from diffserve.api import DiffGenerator

    imported = time.perf_counter()
    generator = DiffGenerator.from_pretrained(
        args.model_dir, device="cpu", dtype="float32", show_progress=False, compile=True
    )
    loaded = time.perf_counter()
    generator.generate(
        prompt="a red fox in the snow", height=args.size, width=args.size,
        num_inference_steps=args.steps, seed=0,
    )  # fmt: skip
    done = time.perf_counter()
    # CPU seconds of this process and its reaped children (inductor's compile workers, shut down after the
    # warm-up): the compile's work, which a busy machine stretches in wall time but not in CPU time.
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result = {
        "cpu_s": sum(u.ru_utime + u.ru_stime for u in usage),
        "import_s": imported - start,
        "from_pretrained_s": loaded - imported,
        "first_image_s": done - loaded,
        "from_pretrained_to_image_s": done - imported,
        # Trees before issue 37 record no `cpu_gemm`: their compiled matmuls were MKL's.
        "cpu_gemm": sorted({getattr(r, "cpu_gemm", "mkl") for r in generator.compiled_regions}),
    }
    print(json.dumps(result))


def run_one(args: argparse.Namespace, pythonpath: str, cache_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    command = [
        sys.executable, os.path.abspath(__file__), WORKER_FLAG, "--model-dir", str(args.model_dir),
        "--size", str(args.size), "--steps", str(args.steps),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"worker failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, required=True, help="a diffusers folder diffserve can load")
    p.add_argument("--variant", action="append", default=[], help="NAME=PYTHONPATH (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=256, help="the first image's side (default 256)")
    p.add_argument("--steps", type=int, default=6, help="the first image's steps (default 6)")
    p.add_argument("--warm-cache", action="store_true", help="share one filled inductor cache per variant")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    variants = dict(v.split("=", 1) for v in args.variant) or {"current": "src"}
    variants = {name: str(Path(path).resolve()) for name, path in variants.items()}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="diffserve-cold-start-") as tmp:
        warm_dirs = {name: str(Path(tmp) / f"warm-{name}") for name in variants}
        if args.warm_cache:
            for name, path in variants.items():
                print(f"filling {name}'s inductor cache ...", file=sys.stderr, flush=True)
                run_one(args, path, warm_dirs[name])
        names = list(variants)
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                cache = warm_dirs[name] if args.warm_cache else str(Path(tmp) / f"cold-{name}-{round_}")
                result = run_one(args, variants[name], cache)
                results[name].append(result)
                print(
                    f"round {round_ + 1} {name}: {result['from_pretrained_to_image_s']:.1f} s "
                    f"(from_pretrained {result['from_pretrained_s']:.1f} s, first image {result['first_image_s']:.1f} s, "
                    f"load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
    first = names[0]
    cache = "filled (warm)" if args.warm_cache else "empty (cold)"
    print(f"# --compile: from_pretrained to the first image, inductor cache {cache}")
    print(f"\n{args.model_dir}, {args.size}x{args.size}, {args.steps} steps, {args.rounds} rounds\n")
    print(
        f"| variant | median s (range) | from_pretrained s | first image s | ratio to {first} "
        f"| CPU s (self + compile workers) | CPU ratio to {first} | CPU GEMM |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in names:
        total = [r["from_pretrained_to_image_s"] for r in results[name]]
        ratio = statistics.median(
            t / f["from_pretrained_to_image_s"] for t, f in zip(total, results[first], strict=True)
        )
        cpu_ratio = statistics.median(
            r["cpu_s"] / f["cpu_s"] for r, f in zip(results[name], results[first], strict=True)
        )
        print(
            f"| {name} | {statistics.median(total):.1f} ({min(total):.1f}-{max(total):.1f}) "
            f"| {statistics.median(r['from_pretrained_s'] for r in results[name]):.1f} "
            f"| {statistics.median(r['first_image_s'] for r in results[name]):.1f} | {ratio:.2f}x "
            f"| {statistics.median(r['cpu_s'] for r in results[name]):.1f} | {cpu_ratio:.2f}x "
            f"| {', '.join(results[name][-1]['cpu_gemm'])} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"model_dir": str(args.model_dir)}, "results": results},
                default=str,
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
