"""How long a multi-rank engine takes to start under each `DIFFSERVE_START_METHOD` (`process_start.py`).

Each run is a new Python process that builds `DiffGenerator.from_pretrained(model, num_gpus=N,
ulysses_degree=N)` on the CPU (N gloo ranks: rank 0 here, N-1 started by the chosen method) and closes
it; the figure is the wall time from the call to a ready engine. The methods alternate, `--repeats`
rounds, so a change in the machine's load falls on both alike; the table gives each method's median
and its ratio to 'spawn'.

    .venv/bin/python benchmarks/bench_process_start.py --num-gpus 4 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from diffserve.configs.demo_model import demo_model_path
from diffserve.process_start import START_METHOD_ENV

METHODS = ("spawn", "forkserver")
CHILD = """
import sys, time
from diffserve import DiffGenerator

if __name__ == "__main__":
    started = time.monotonic()
    n = int(sys.argv[2])
    with DiffGenerator.from_pretrained(sys.argv[1], num_gpus=n, ulysses_degree=n, show_progress=False):
        print(time.monotonic() - started)
"""


def start_seconds(model: str, num_gpus: int, method: str) -> float:
    """One new process's time from `from_pretrained` to a ready engine under `method`."""
    env = {**os.environ, START_METHOD_ENV: method, "OMP_NUM_THREADS": "1"}
    begun = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(num_gpus)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{method}: exited {result.returncode}\n{result.stderr[-3000:]}")
    print(
        f"  {method}: ready in {float(result.stdout.split()[-1]):.2f} s ({time.monotonic() - begun:.2f} s in all)"
    )
    return float(result.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=str(demo_model_path()))
    parser.add_argument("--num-gpus", type=int, default=4, help="ranks (CPU: gloo processes)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    for round_index in range(args.repeats):
        print(f"round {round_index + 1}")
        for method in METHODS:
            times[method].append(start_seconds(args.model_path, args.num_gpus, method))
    base = statistics.median(times["spawn"])
    print(f"\n| start method | engine ready, {args.num_gpus} ranks (median of {args.repeats}) | vs spawn |")
    print("|---|---:|---:|")
    for method in METHODS:
        median = statistics.median(times[method])
        print(f"| {method} | {median:.2f} s | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
