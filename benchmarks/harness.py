"""Shared machinery of the diffserve-vs-diffusers benchmarks (`bench_flux_vs_diffusers.py`, `bench_families.py`).

The method, common to every script: each measurement runs in a fresh subprocess (the script re-invoked
as a worker), engines alternating, so peak RSS is per engine and neither engine inherits the other's
warm caches or allocator state. A worker loads its pipeline (timed), runs one uncounted warm-up
generation, times `--repeats` generations, saves its first timed image as a lossless PNG and prints one
JSON line after `RESULT_MARKER`. The parent pools the workers of one engine and resolution, compares the
two engines' images (PSNR, same seed) and renders a Markdown table of diffusers / diffserve ratios.

This module holds the worker side (RSS, step timing of diffusers, DiT call counting, the timed loop),
the parent side (spawning workers, pooling rounds, PSNR, contention check) and the table rendering.
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
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffserve.testing.image_metrics import psnr_uint8 as psnr

ENGINES = ("diffserve", "diffusers")
RESULT_MARKER = "BENCH_RESULT "
PSNR_BAR_DB = 40.0  # DESIGN.md correctness bar for whole generations
#: A worker keeps about `torch_threads` cores busy; a 1-min load average above that plus this margin
#: means other processes competed for the CPU during its measurement.
CONTENTION_MARGIN = 1.0

#: A worker's `generate()`: one whole generation -> (PIL image, seconds of each denoising step).
Generate = Callable[[], tuple[Any, list[float]]]


# --------------------------------------------------------------------------------------------- worker


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


class ForwardCounter:
    """Counts calls of a module's `forward` by shadowing it with an instance attribute.

    `nn.Module.__call__` looks `forward` up on the instance, so every call through the module (hooks
    included) is counted, whichever engine makes it. It shows how many DiT forwards a denoising step
    costs: one when an engine batches the CFG branches, two when it runs them one after the other.
    """

    def __init__(self, module: Any) -> None:
        self.calls = 0
        self._forward = module.forward
        module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._forward(*args, **kwargs)


class DiffusersStepTimer:
    """Times diffusers' denoising steps over the same span as diffserve's `step_times`.

    One step runs from its first transformer call (a forward pre-hook; true CFG calls the transformer
    twice per step, only the first starts the clock) to the end of its scheduler step, where diffusers
    calls `callback_on_step_end`: pass `timer.on_step_end` as that callback.
    """

    def __init__(self, transformer: Any, *more_transformers: Any) -> None:
        """`more_transformers`: other DiTs a step may call instead (Wan 2.2 A14B's `transformer_2`)."""
        self.starts: list[float] = []
        self.ends: list[float] = []
        for dit in (transformer, *more_transformers):
            dit.register_forward_pre_hook(self._on_transformer_call)

    def _on_transformer_call(self, module: Any, inputs: Any) -> None:
        if len(self.starts) == len(self.ends):  # first DiT call of this step
            self.starts.append(time.perf_counter())

    def on_step_end(self, pipeline: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
        self.ends.append(time.perf_counter())
        return callback_kwargs

    def reset(self) -> None:
        self.starts.clear()
        self.ends.clear()

    def step_times(self, steps: int) -> list[float]:
        """The last generation's step times; raises if the hooks did not see exactly `steps` steps."""
        if len(self.starts) != len(self.ends) or len(self.ends) != steps:
            raise RuntimeError(
                f"step timing hooks saw {len(self.starts)} starts / {len(self.ends)} ends for {steps} steps"
            )
        return [e - s for s, e in zip(self.starts, self.ends, strict=True)]


def run_timed_generations(
    engine: str,
    size: int,
    load: dict[str, float],
    generate: Generate,
    repeats: int,
    image_out: Path,
    dit_counter: ForwardCounter | None = None,
    extra: dict | None = None,
    after_warmup: Callable[[], None] | None = None,
) -> None:
    """The worker's measurement: one warm-up, `repeats` timed generations, then the result line.

    `load` holds `import_s` and `from_pretrained_s`. The warm-up generation's time is recorded as
    `warmup_s` (the first call, where torch.compile compiles). With `dit_counter`, the result also
    carries the DiT forward calls per denoising step of the timed runs (`dit_calls_per_step`).
    `after_warmup()` runs between the warm-up and the timed runs, untimed (e.g. `stop_compile_workers`).
    """
    import numpy as np
    import torch
    from PIL import Image

    warmup_start = time.perf_counter()
    generate()  # warm-up, not counted (timed apart: with torch.compile it is where compilation happens)
    warmup_s = time.perf_counter() - warmup_start
    if after_warmup is not None:
        after_warmup()
    e2e: list[float] = []
    step_times: list[list[float]] = []
    calls_per_step: list[float] = []
    images = []
    for _ in range(repeats):
        if dit_counter is not None:
            dit_counter.calls = 0
        start = time.perf_counter()
        image, steps = generate()
        e2e.append(time.perf_counter() - start)
        step_times.append(steps)
        if dit_counter is not None:
            calls_per_step.append(dit_counter.calls / len(steps))
        images.append(np.asarray(image.convert("RGB")))
    Image.fromarray(images[0]).save(image_out)  # lossless PNG: the parent computes PSNR from it
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
        "warmup_s": warmup_s,
        "peak_rss_mb": peak_rss_mb(),
        "repeats_identical": all(np.array_equal(images[0], im) for im in images[1:]),
        "image_std": float(images[0].std()),
        "torch_threads": torch.get_num_threads(),
        "image": str(image_out),
    }
    if dit_counter is not None:
        result["dit_calls_per_step"] = statistics.fmean(calls_per_step)
    result.update(extra or {})
    print(RESULT_MARKER + json.dumps(result), flush=True)


def stop_compile_workers() -> None:
    """Shut down inductor's compile-worker processes (a no-op when none were started).

    torch.compile starts a pool of compile-worker processes in the background on its first compile
    and leaves it running. When the compile finishes quickly (inductor's on-disk cache hits) the pool
    is still starting when the timed runs begin: on a 2-core machine its workers' start-up (each
    imports torch) took the CPU from the timed steps for up to ~25 s, making a compiled step over
    10x slower than its steady state. A compiled engine's worker calls this after its warm-up generation,
    so its timed runs measure the compiled model alone; a later recompile would start a new pool.
    """
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()


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
    """Parameters in `model_dir/transformer/*.safetensors`, read from the headers only."""
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


class WorkerFailed(SystemExit):
    """A worker exited non-zero or printed no result line.

    A SystemExit, so a script that does not catch it ends with the same message as always; a script
    that measures engines which may legitimately fail (a third-party torch.compile) catches it and
    reports `error`, the worker's last stderr line (usually the exception), in its table instead.
    """

    def __init__(self, tag: str, engine: str, size: int, returncode: int, stderr: str) -> None:
        super().__init__(f"worker {tag}{engine} {size} failed with exit code {returncode}")
        lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        self.engine = engine
        self.error = lines[-1] if lines else f"exit code {returncode}, no output on stderr"


def run_worker(cmd: list[str], engine: str, size: int, timeout: float, tag: str = "") -> dict:
    """Run one worker subprocess (`cmd`), parse its result line, note the load average around it.

    Raises `WorkerFailed` (after echoing the worker's output tail) when the worker fails.
    """
    print(f"  {tag}{engine:9s} {size}x{size} ...", end="", flush=True, file=sys.stderr)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise WorkerFailed(tag, engine, size, proc.returncode, proc.stderr)
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr)
    result = json.loads(lines[-1][len(RESULT_MARKER) :])
    # The worker itself keeps ~torch_threads cores busy; a higher load means other processes competed.
    result["loadavg_1m"] = [load_before, os.getloadavg()[0]]
    return result


def merge_rounds(results: list[dict]) -> dict:
    """Pool the timed generations of several worker processes of one engine and resolution."""
    step_times = [run for r in results for run in r["step_times_s"]]
    e2e = [t for r in results for t in r["e2e_s"]]
    merged = {
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
    if all("warmup_s" in r for r in results):
        merged["warmup_s"] = [r["warmup_s"] for r in results]
    if "dit_calls_per_step" in results[0]:
        merged["dit_calls_per_step"] = statistics.fmean(r["dit_calls_per_step"] for r in results)
    return merged


def image_psnr(path_a: str | Path, path_b: str | Path) -> float:
    """PSNR in dB between two saved images (inf when identical)."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(path_a).convert("RGB"))
    b = np.asarray(Image.open(path_b).convert("RGB"))
    return psnr(a, b)


def run_engines(
    size: int,
    rounds: int,
    worker_cmd: Callable[[str, int, Path], list[str]],
    image_dir: Path,
    timeout: float,
    *,
    engines: Sequence[str] = ENGINES,
    rotate: bool = False,
    may_fail: Collection[str] = (),
    after_round: Callable[[], None] | None = None,
    tag: str = "",
    image_prefix: str = "",
) -> dict[str, dict]:
    """Every engine's workers at one size, `rounds` times, pooled per engine: `{engine: row}`.

    `rotate` shifts the engine order by one each round, so with several engines no one of them always
    runs first (or right after the same neighbour). An engine in `may_fail` whose worker fails gets the
    row `{"engine", "resolution", "error"}` instead of ending the run, and is not retried at this size
    (a compile error is deterministic). `after_round()` runs after each round (e.g. a matmul-rate sample).
    """
    per_engine: dict[str, list[dict]] = {e: [] for e in engines}
    failed: dict[str, str] = {}
    for round_ in range(rounds):
        shift = round_ % len(engines) if rotate else 0
        for engine in [*engines[shift:], *engines[:shift]]:
            if engine in failed:
                continue
            image_out = image_dir / f"{image_prefix}{engine}_{size}_r{round_}.png"
            try:
                per_engine[engine].append(
                    run_worker(worker_cmd(engine, size, image_out), engine, size, timeout, tag)
                )
            except WorkerFailed as exc:
                if engine not in may_fail:
                    raise
                print(f"  {tag}{engine} FAILED, reported in the table: {exc.error}", file=sys.stderr)
                failed[engine] = exc.error
        if after_round is not None:
            after_round()
    return {
        e: {"engine": e, "resolution": size, "error": failed[e]}
        if e in failed
        else merge_rounds(per_engine[e])
        for e in engines
    }


def compare_engines(
    sizes: Sequence[int],
    rounds: int,
    worker_cmd: Callable[[str, int, Path], list[str]],
    image_dir: Path,
    timeout: float,
    tag: str = "",
    image_prefix: str = "",
) -> tuple[dict[int, dict[str, dict]], dict[int, float]]:
    """Run every worker (per size: `rounds` x the engines, alternating), pool them and compute PSNR.

    `worker_cmd(engine, size, image_out)` is the command line of one worker. Returns the pooled rows,
    `{size: {engine: row}}`, and the PSNR between the engines' images, `{size: dB}`.
    """
    rows: dict[int, dict[str, dict]] = {}
    parity: dict[int, float] = {}
    for size in sizes:
        rows[size] = run_engines(
            size, rounds, worker_cmd, image_dir, timeout, tag=tag, image_prefix=image_prefix
        )
        parity[size] = image_psnr(rows[size]["diffserve"]["image"], rows[size]["diffusers"]["image"])
    return rows, parity


# ------------------------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Column:
    """An extra table column, placed before PSNR: its per-engine cell and its ratio-row cell."""

    title: str
    cell: Callable[[dict], str]
    ratio_cell: Callable[[dict, dict], str]  # (diffserve row, diffusers row) -> cell


def machine_lines(info: dict) -> list[str]:
    return [
        f"- machine: {info['cpu']}, {info['cores']} cores, torch threads {info['torch_threads']}",
        f"- python {info['python']}, torch {info['torch']}, diffusers {info['diffusers']}, "
        f"transformers {info['transformers']}",
    ]


def psnr_cell(value: float) -> str:
    cell = "inf (identical)" if value == float("inf") else f"{value:.1f}"
    if value < PSNR_BAR_DB:
        cell += " BELOW BAR"
    return cell


def results_table(
    sizes: Sequence[int],
    rows: dict[int, dict[str, dict]],
    parity: dict[int, float],
    columns: Sequence[Column] = (),
) -> tuple[list[str], list[str]]:
    """The Markdown table (two engine rows and a ratio row per size) and its "Raw timings" notes."""
    extra_titles = "".join(f" {c.title} |" for c in columns)
    extra_rule = "---:|" * len(columns)
    out = [
        f"| resolution | engine | load s | s/step | end-to-end s | peak RSS MB |{extra_titles} PSNR dB |",
        f"|---|---|---:|---:|---:|---:|{extra_rule}---:|",
    ]
    notes = []
    for size in sizes:
        ours, ref = rows[size]["diffserve"], rows[size]["diffusers"]
        res = f"{size}x{size}"
        for r in (ours, ref):
            extra = "".join(f" {c.cell(r)} |" for c in columns)
            out.append(
                f"| {res} | {r['engine']} | {r['load_s']:.2f} | {r['s_per_step']:.3f} | {r['e2e_mean_s']:.2f} "
                f"| {r['peak_rss_mb']:.0f} |{extra} |"
            )
        extra = "".join(f" {c.ratio_cell(ours, ref)} |" for c in columns)
        out.append(
            f"| {res} | **diffusers/diffserve** | {ref['load_s'] / ours['load_s']:.2f}x "
            f"| **{ref['s_per_step'] / ours['s_per_step']:.2f}x** | **{ref['e2e_mean_s'] / ours['e2e_mean_s']:.2f}x** "
            f"| {ref['peak_rss_mb'] / ours['peak_rss_mb']:.2f}x |{extra} {psnr_cell(parity[size])} |"
        )
        for r in (ours, ref):
            notes += raw_timing_notes(res, r)
    return out, notes


def raw_timing_notes(res: str, r: dict) -> list[str]:
    """The "Raw timings" lines of one engine row: load split, every run and step, load average, warnings."""
    runs = ", ".join(f"{t:.2f}" for t in r["e2e_s"])
    steps = ", ".join(f"{t:.3f}" for run in r["step_times_s"] for t in run)
    notes = [
        f"- {res} {r['engine']}: load = import {r['import_s']:.2f} s + from_pretrained "
        f"{r['from_pretrained_s']:.2f} s; end-to-end s per run [{runs}]; s per step [{steps}]"
    ]
    loads = ", ".join(f"{x:.1f}" for x in r["loadavg_1m"])
    notes.append(f"  - 1-min load average before/after its worker: {loads}")
    if not r["repeats_identical"]:
        notes.append(f"  - WARNING: {r['engine']} produced different images across repeats with one seed")
    if r["image_std"] <= 5:
        notes.append(f"  - WARNING: {r['engine']} image is nearly flat; the PSNR comparison proves little")
    return notes


def contention_lines(sizes: Sequence[int], rows: dict[int, dict[str, dict]], torch_threads: int) -> list[str]:
    """A warning paragraph (with its leading blank line) when a worker ran on a busy machine; else []."""
    contended = [
        f"{r['resolution']}x{r['resolution']} {r['engine']} (1-min load up to {max(r['loadavg_1m']):.1f})"
        for size in sizes
        for r in rows[size].values()
        if "error" not in r and max(r["loadavg_1m"]) > torch_threads + CONTENTION_MARGIN
    ]
    if not contended:
        return []
    return [
        "",
        f"**WARNING: CPU contention** (load above {torch_threads} torch threads + "
        f"{CONTENTION_MARGIN:g}) during: {'; '.join(contended)}. These timings and ratios are unreliable; "
        "rerun on an idle machine.",
    ]


def first_call_cell(row: dict) -> str:
    """Each worker's warm-up generation, in seconds (where diffusers' torch.compile compiles)."""
    return ", ".join(f"{s:.1f}" for s in row.get("warmup_s", [])) or "-"


def ready_s(row: dict) -> float | None:
    """Load + first call, mean over workers: the time to a first image, compilation included wherever
    the engine does it (diffserve compiles inside from_pretrained, diffusers on the first call)."""
    warmups = row.get("warmup_s", [])
    return row["load_s"] + sum(warmups) / len(warmups) if warmups else None


def ready_cell(row: dict) -> str:
    seconds = ready_s(row)
    return "-" if seconds is None else f"{seconds:.1f}"


def legend() -> str:
    """The paragraph under a results table that says how to read it."""
    return (
        "Ratios are diffusers / diffserve: >1 means diffserve is faster (load, s/step, end-to-end) or smaller "
        f"(RSS). PSNR compares the two engines' images for the same seed (bar: {PSNR_BAR_DB:.0f} dB). "
        "Load is a cold start in a fresh process with torch already imported: the engine's imports plus "
        "from_pretrained. A load average well above the torch thread count means other processes "
        "competed for the CPU during that measurement; rerun on an idle machine (or with --rounds 2+)."
    )


# ------------------------------------------------------------------------------------------------- CLI


def add_run_args(
    p: argparse.ArgumentParser,
    default_resolutions: str,
    model_dir_help: str,
    rounds: tuple[int, str] = (
        1,
        "worker processes per engine and resolution, alternating engines; results pooled",
    ),
) -> None:
    """The options every benchmark script shares that come before its own (checkpoint, sizes, timing).

    `rounds`: `--rounds`' default and meaning (the in-process scripts count rounds, not processes).
    """
    p.add_argument("--model-dir", type=Path, default=None, help=model_dir_help)
    p.add_argument(
        "--resolutions",
        default=default_resolutions,
        help=f"comma-separated square sizes (default: {default_resolutions})",
    )
    p.add_argument("--steps", type=int, default=4, help="denoising steps per generation (default: 4)")
    p.add_argument(
        "--repeats", type=int, default=2, help="timed generations per worker, after 1 warm-up (default: 2)"
    )
    p.add_argument("--rounds", type=int, default=rounds[0], help=f"{rounds[1]} (default: {rounds[0]})")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--prompt", default="a red fox in the snow, golden hour, highly detailed")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark script shares that come after its own (outputs, worker plumbing)."""
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
    p.add_argument("--image-dir", type=Path, default=None, help="keep the compared images here")
    p.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds before a worker is killed")
    p.add_argument("--worker", nargs=2, metavar=("ENGINE", "RES"), help=argparse.SUPPRESS)
    p.add_argument("--image-out", type=Path, help=argparse.SUPPRESS)


def check_run_args(p: argparse.ArgumentParser, args: argparse.Namespace, size_multiple: int = 16) -> None:
    """Parse `--resolutions` into `args.sizes` and validate the shared options (exits on a bad value)."""
    args.sizes = [int(s) for s in args.resolutions.split(",") if s.strip()]
    if args.steps < 1 or args.repeats < 1 or args.rounds < 1:
        p.error("--steps, --repeats and --rounds must be >= 1")
    for size in args.sizes:
        if size <= 0 or size % size_multiple:
            p.error(f"resolution {size} must be a positive multiple of {size_multiple}")


def parse_worker(args: argparse.Namespace, engines: Collection[str] = ENGINES) -> tuple[str, int]:
    """`--worker ENGINE RES` -> (engine, size); exits on an engine not in `engines`."""
    engine, size = args.worker
    if engine not in engines:
        raise SystemExit(f"unknown engine {engine!r}")
    return engine, int(size)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str))


def settings_for_json(args: argparse.Namespace) -> dict:
    """The run's options as recorded in the JSON output (worker plumbing left out)."""
    return {k: v for k, v in vars(args).items() if k not in ("worker", "image_out", "json")}
