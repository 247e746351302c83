"""CPU contention (issue 31 item 6): how much slower the engine gets when other processes keep the CPUs
busy, with the old thread defaults and with the engine's defaults.

For each model (the shipped demo model, as `make demo` runs it, and a random-weight tiny FLUX written by
`diffserve make-tiny flux`), each number of busy background processes (pure-Python `while True: pass`
loops, started before the worker and stopped after it) and each arm, a fresh worker process loads the model
through `DiffGenerator` and, after a warm-up, alternates per round:

- one at a time: `--prompts` `generate` calls of one prompt each (s/step at batch 1: their median step);
- batched: one `generate` call with the `--prompts` prompts, whose denoising steps share DiT batches.

Arms (`--arms`, comma-separated):

- `before`: what the engine did before issue 31: OpenMP's own wait policy (threads spin: GOMP_SPINCOUNT
  300000 is libgomp's default, KMP_BLOCKTIME 200 Intel's) and torch's default thread count (the CPUs of
  the affinity mask);
- `after`: the engine's defaults (no variable set: OMP_WAIT_POLICY=PASSIVE and KMP_BLOCKTIME=0 from
  `diffserve.openmp_env`, threads from `CpuPlatform.configure_threads`);
- `POLICY:N` for exploring: POLICY `spin`, `passive` or `spinCOUNT` (GOMP_SPINCOUNT=COUNT polls before a
  waiting thread sleeps), N threads (`--cpu-threads N`).

Each worker gets OMP_NUM_THREADS unset. The machine's load is reported with each row: the mean number of
runnable tasks sampled every 0.2 s while the worker ran (/proc/loadavg's 4th field, the sampler excluded;
it counts the busy processes, the worker's threads and everything else on the machine) and the 1-minute
load average at its end.
`--repeats` sweeps every cell again (arms interleaved within a load level) and reports medians, with
their range in brackets.

    .venv/bin/python benchmarks/bench_cpu_contention.py --repeats 3    # 8 steps, 4 prompts, 2 rounds per worker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# Before torch (imported by the worker): `import diffserve` sets the engine's OpenMP wait policy, which
# OpenMP reads once, when torch loads it.
import diffserve  # noqa: F401

#: Variables a worker starts without, so that each arm sets exactly what it tests.
CLEARED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
#: OpenMP's own defaults when no variable is set (libgomp: spin about 300,000 polls; Intel's: 200 ms).
SPIN_ENV = {"GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
PROMPTS = [
    "a large red circle in the center on a black background",
    "a small blue square at the top left on a white background",
    "a large green triangle at the bottom right on a grey background",
    "a small yellow star in the center on a black background",
    "a large purple circle at the top right on a white background",
    "a small orange square at the bottom left on a grey background",
    "a large white triangle in the center on a black background",
    "a small red star at the top left on a white background",
]


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def arm_settings(arm: str) -> tuple[dict[str, str], int | None, str]:
    """(environment, cpu_threads, description) of an arm."""
    if arm == "before":
        return SPIN_ENV, affinity_cpus(), "spin, torch default threads"
    if arm == "after":
        return {}, None, "engine defaults"
    policy, _, threads = arm.partition(":")
    count = policy.removeprefix("spin")
    if not (policy in ("spin", "passive") or count.isdigit()) or not threads.isdigit() or int(threads) < 1:
        raise SystemExit(f"unknown arm {arm!r}: before, after, or POLICY:N (POLICY spin, spinCOUNT, passive)")
    env = PASSIVE_ENV if policy == "passive" else SPIN_ENV if policy == "spin" else {"GOMP_SPINCOUNT": count}
    return env, int(threads), f"{policy}, {threads} threads"


# -- worker -----------------------------------------------------------------------------------------


def run_worker(spec: dict) -> dict:
    import torch

    from diffserve import DiffGenerator

    keywords = {} if spec["cpu_threads"] is None else {"cpu_threads": spec["cpu_threads"]}
    gen = DiffGenerator.from_pretrained(
        spec["model"], device="cpu", dtype="float32", show_progress=False, **keywords
    )
    prompts = PROMPTS[: spec["prompts"]]
    settings = {"seed": 0, "height": spec["size"], "width": spec["size"]}

    def one_at_a_time(steps: int) -> tuple[float, list[float]]:
        start, step_times = time.perf_counter(), []
        for prompt in prompts:
            step_times += gen.generate(prompt=prompt, num_inference_steps=steps, **settings).step_times
        return time.perf_counter() - start, step_times

    def batched(steps: int) -> float:
        start = time.perf_counter()
        gen.generate(prompt=prompts, num_inference_steps=steps, **settings)
        return time.perf_counter() - start

    one_at_a_time(2)  # warm-up of both arms
    batched(2)
    single, batch, steps_b1, ratios = [], [], [], []
    for round_index in range(spec["rounds"]):
        if round_index % 2:
            b = batched(spec["steps"])
            s, times = one_at_a_time(spec["steps"])
        else:
            s, times = one_at_a_time(spec["steps"])
            b = batched(spec["steps"])
        single.append(s)
        batch.append(b)
        steps_b1 += times
        ratios.append(s / b)
    return {
        "threads": torch.get_num_threads(),
        "s_per_step_b1": statistics.median(steps_b1),
        "one_at_a_time_s": statistics.median(single),
        "batched_s": statistics.median(batch),
        "batching_speedup": statistics.median(ratios),
        "cpu_s": time.process_time(),
    }


# -- driver -----------------------------------------------------------------------------------------


@contextmanager
def busy_processes(count: int):
    """`count` pure-Python busy loops, each one process, stopped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


class RunnableSampler:
    """Mean runnable tasks (/proc/loadavg's 4th field, less the sampler) while it runs."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            except (OSError, ValueError, IndexError):
                return
            self.samples.append(running - 1)

    def __enter__(self) -> RunnableSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def run_cell(model: str, arm: str, busy: int, args: argparse.Namespace) -> dict:
    env_set, cpu_threads, description = arm_settings(arm)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(env_set)
    env["PYTHONWARNINGS"] = "ignore"
    spec = {
        "model": model, "cpu_threads": cpu_threads, "prompts": args.prompts, "steps": args.steps,
        "size": args.size, "rounds": args.rounds,
    }  # fmt: skip
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    with busy_processes(busy), RunnableSampler() as sampler:
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - start
    row = {"arm": arm, "description": description, "busy": busy, "wall_s": wall}
    row["runnable"], row["loadavg_1m"] = sampler.mean, os.getloadavg()[0]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        row["error"] = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"rc {done.returncode}"]
        return row
    row.update(json.loads(lines[-1]))
    return row


def make_tiny_flux(folder: Path) -> str:
    code = "import sys; from diffserve.cli.main import main; sys.argv = ['diffserve', *sys.argv[1:]]; main()"
    subprocess.run(
        [sys.executable, "-c", code, "make-tiny", "flux", str(folder)], check=True, capture_output=True
    )
    return str(folder)


def fmt(value: float | None, digits: int = 3, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"


METRICS = ("runnable", "loadavg_1m", "s_per_step_b1", "one_at_a_time_s", "batched_s", "batching_speedup")


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (model, arm, busy): each metric's median over the repeats that ran, and its range."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["arm"], r["busy"]), []).append(r)
    out = []
    for (model, arm, busy), runs in groups.items():
        ok = [r for r in runs if "error" not in r]
        row = {"model": model, "arm": arm, "busy": busy, "repeats": len(ok), "failed": len(runs) - len(ok)}
        if not ok:
            row["error"] = runs[-1]["error"]
            out.append(row)
            continue
        row["description"], row["threads"] = ok[0]["description"], ok[0]["threads"]
        for key in METRICS:
            values = [r[key] for r in ok if r[key] is not None]
            row[key] = statistics.median(values) if values else None
            row[f"{key}_range"] = (min(values), max(values)) if values else None
        out.append(row)
    return out


def span(row: dict, key: str, digits: int) -> str:
    low, high = row[f"{key}_range"] or (None, None)
    if row["repeats"] < 2 or low is None:
        return ""
    return f" ({low:.{digits}f}-{high:.{digits}f})"


def table(rows: list[dict], prompts: int) -> list[str]:
    """Markdown: medians over the repeats (their range in brackets), ratios of medians to the 0-busy row."""
    lines = [
        "| model | arm | busy procs | threads | runnable (mean) | load 1m | s/step, batch 1 | x vs 0 busy "
        f"| {prompts} one at a time (s) | batch of {prompts} (s) | x vs 0 busy | batching speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(r["model"], r["arm"]): r for r in rows if r["busy"] == 0 and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['arm']} | {r['busy']} | error: {' '.join(r['error'])} |")
            continue
        b = base.get((r["model"], r["arm"]))
        step_x = r["s_per_step_b1"] / b["s_per_step_b1"] if b else None
        batch_x = r["batched_s"] / b["batched_s"] if b else None
        lines.append(
            f"| {r['model']} | {r['arm']} ({r['description']}) | {r['busy']} | {r['threads']} "
            f"| {fmt(r['runnable'], 1)} | {r['loadavg_1m']:.1f} "
            f"| {fmt(r['s_per_step_b1'], 4)}{span(r, 's_per_step_b1', 4)} | {fmt(step_x, 2, 'x')} "
            f"| {fmt(r['one_at_a_time_s'], 2)} | {fmt(r['batched_s'], 2)} | {fmt(batch_x, 2, 'x')} "
            f"| {fmt(r['batching_speedup'], 2, 'x')}{span(r, 'batching_speedup', 2)} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--models", default="demo,flux", help="demo, flux, or a model folder (default: demo,flux)"
    )
    parser.add_argument("--busy", default="0,1,2", help="busy background processes per row (default: 0,1,2)")
    parser.add_argument("--arms", default="before,after", help="before, after, spin:N, passive:N")
    parser.add_argument(
        "--prompts", type=int, default=4, help="prompts batched vs one at a time (default: 4)"
    )
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per request (default: 8)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default: 64)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both arms per worker (default: 2)")
    parser.add_argument("--repeats", type=int, default=1, help="sweeps of every cell, medians reported")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per worker (default: 600)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}")
    busy_levels = [int(x) for x in args.busy.split(",")]
    arms = args.arms.split(",")
    for arm in arms:
        arm_settings(arm)
    with tempfile.TemporaryDirectory() as tmp:
        models: dict[str, str] = {}
        for name in args.models.split(","):
            if name == "demo":
                from diffserve.configs.demo_model import demo_model_path

                models[name] = str(demo_model_path())
            elif name == "flux":
                models[name] = make_tiny_flux(Path(tmp) / "tiny-flux")
            else:
                models[Path(name).name] = name
        print(
            f"{affinity_cpus()} CPUs in the affinity mask; load average at start {os.getloadavg()}",
            flush=True,
        )
        rows = []
        for repeat in range(args.repeats):  # whole sweeps, arms interleaved: drift hits every cell alike
            for busy in busy_levels:
                for name, path in models.items():
                    for arm in arms:
                        row = {"model": name, "repeat": repeat, **run_cell(path, arm, busy, args)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    order = {(m, a): i for i, (m, a) in enumerate((m, a) for m in models for a in arms)}
    summary = sorted(summarize(rows), key=lambda r: (order[(r["model"], r["arm"])], r["busy"]))
    print()
    print(
        f"{args.prompts} prompts x {args.steps} steps at {args.size}x{args.size}, {args.rounds} rounds per worker, "
        f"medians of {args.repeats} repeats"
    )
    print("\n".join(table(summary, args.prompts)))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": str(args.json)}, "rows": rows, "summary": summary},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
