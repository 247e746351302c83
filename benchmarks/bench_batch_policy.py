"""`--batch-policy auto` against one-at-a-time serving and full step batching, side by side in one run.

    .venv/bin/python benchmarks/bench_batch_policy.py                      # every case below, one round
    .venv/bin/python benchmarks/bench_batch_policy.py --cases flux-small:256 --rounds 3 --json out.json

Per case (a model and a size), three `diffserve serve` servers in turn, each started fresh with the same
flags but one: `--max-running-requests 1` (one at a time), `--batch-policy throughput` (every running
request of a shape in each step: full batching) and `--batch-policy auto` (the default), each sent
`--num-requests` requests of `--steps` steps at `--concurrency` in flight (closed loop: a new one as one
finishes), after one untimed request. Modes alternate within a round; with several rounds each ratio is
the median over rounds. Reported per case: images/s and p50 latency per mode, auto's throughput over the
better of the other two (the issue asks >= 0.97) and auto's p50 over one-at-a-time's (<= 1).

Cases: `flux-small:SIZE` (bench_flux_vs_diffusers.py's 36.6M FLUX-architecture DiT: compute-bound on a
CPU), `tiny:SIZE` (`diffserve make-tiny flux`: overhead-bound), `demo:SIZE` (the shipped demo model)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_serving  # noqa: E402  (a sibling script, not a package)

MODES = {
    "one at a time": ["--max-running-requests", "1"],
    "full batching": ["--batch-policy", "throughput"],
    "auto": ["--batch-policy", "auto"],
}
DEFAULT_CASES = "flux-small:256,flux-small:512,tiny:64,demo:64"


def resolve(model: str, work: Path) -> str:
    """A case's model folder: built once under `work` where it is a built-in name."""
    if model == "tiny":
        root = work / "tiny-flux"
        if not (root / "model_index.json").is_file():
            cli = [sys.executable, "-m", "diffserve.cli.main", "make-tiny", "flux", str(root)]
            subprocess.run(cli, check=True, capture_output=True)
        return str(root)
    return bench_serving.resolve_model(model, str(work / model) if model == "flux-small" else None)


def serve_once(model_dir: str, flags: list[str], args: argparse.Namespace, size: int, log: Path) -> dict:
    """One fresh server with `flags`, one untimed request, then the timed closed loop."""
    load = bench_serving.parse_args(
        [
            "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
            "--size", f"{size}x{size}", "--steps", str(args.steps), "--warmup", "1",
        ]
    )  # fmt: skip
    running = int(flags[1]) if flags[0] == "--max-running-requests" else args.max_running_requests
    extra = flags if flags[0] != "--max-running-requests" else []
    with bench_serving.LaunchedServer(model_dir, running, extra, log) as server:
        load.base_url = server.base_url
        report = asyncio.run(bench_serving.run(load, args.concurrency))
    if report.failed:
        raise RuntimeError(f"{report.failed} request(s) failed ({report.failures}); see {log}")
    return asdict(report)


def run_case(case: str, args: argparse.Namespace, work: Path) -> dict:
    model, _, size = case.partition(":")
    model_dir = resolve(model, work)
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        by_mode = {}
        for mode, flags in MODES.items():
            print(f"== {case} round {r + 1}: {mode}", flush=True)
            log = work / f"{case.replace(':', '-')}-{mode.replace(' ', '-')}-{r}.log"
            by_mode[mode] = serve_once(model_dir, flags, args, int(size), log)
            report = by_mode[mode]
            print(
                f"   {report['images_per_s']:.3f} images/s, p50 {report['latency_s']['p50']:.2f} s",
                flush=True,
            )
        rounds.append(by_mode)
    throughput_ratio = statistics.median(
        rnd["auto"]["images_per_s"]
        / max(rnd["one at a time"]["images_per_s"], rnd["full batching"]["images_per_s"])
        for rnd in rounds
    )
    p50_ratio = statistics.median(
        rnd["auto"]["latency_s"]["p50"] / rnd["one at a time"]["latency_s"]["p50"] for rnd in rounds
    )
    return {
        "case": case,
        "rounds": rounds,
        "auto_throughput_vs_best": throughput_ratio,
        "auto_p50_vs_one": p50_ratio,
    }


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n{args.num_requests} requests of {args.steps} steps at concurrency {args.concurrency}, "
        f"{args.rounds} round(s); medians over rounds\n"
    )
    header = "| case | " + " | ".join(f"{m} images/s | {m} p50 s" for m in MODES)
    print(header + " | auto throughput / best | auto p50 / one-at-a-time p50 |")
    print("|---|" + "---:|" * (2 * len(MODES) + 2))
    for res in results:
        cells = []
        for mode in MODES:
            cells.append(f"{statistics.median(r[mode]['images_per_s'] for r in res['rounds']):.3f}")
            cells.append(f"{statistics.median(r[mode]['latency_s']['p50'] for r in res['rounds']):.2f}")
        ratios = f"{res['auto_throughput_vs_best']:.3f} | {res['auto_p50_vs_one']:.3f}"
        print(f"| {res['case']} | " + " | ".join(cells) + f" | {ratios} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"MODEL:SIZE list (default: {DEFAULT_CASES})")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-running-requests", type=int, default=8, help="of the batching servers (default: 8)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--work-dir", default=None, help="where models are built and logs kept (default: a temp dir)"
    )
    p.add_argument("--json", default=None, help="also write every report here")
    args = p.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-batch-policy-"))
    work.mkdir(parents=True, exist_ok=True)
    results = [run_case(case, args, work) for case in args.cases.split(",")]
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
