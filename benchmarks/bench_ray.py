"""diffserve on Ray Serve (issue 32), side by side in one run on the shipped demo model:

1. throughput: 1 replica against 2 replicas on 2 Ray nodes of 1 CPU each (`ray.cluster_utils.Cluster` on
   the loopback: a head and a worker node), `--num-requests` requests at `--concurrency`, torch on one
   thread per replica (`--cpu-threads 1`, and Ray's 1-CPU workers);
2. the Ray path's cost: p50 latency of one request at a time through Ray Serve (proxy, ingress, replica,
   engine) at 1 replica, against a direct `diffserve serve` with the same engine flags.

    .venv/bin/python benchmarks/bench_ray.py                       # 64 requests at concurrency 8
    .venv/bin/python benchmarks/bench_ray.py --num-requests 16 --steps 8 --latency-requests 8   # quick

The load is bench_serving.py's (same request bodies: prompt, 64x64, `--steps`, a seed per request).
Prints a Markdown table; `--json PATH` writes the reports. Needs the extra: pip install "diffserve[ray]".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import LaunchedServer, Report, free_port, run  # noqa: E402

READY_TIMEOUT_S = 600
APP = "bench"


def load_args(args: argparse.Namespace, base_url: str, requests: int, concurrency: int) -> argparse.Namespace:
    """bench_serving.py's arguments for one pass."""
    return argparse.Namespace(
        base_url=base_url, api_key=None, prompt=args.prompt, n=1, size="64x64", response_format="b64_json",
        model=None, openai_only=False, seed=0, steps=args.steps, num_requests=requests, warmup=2,
        request_rate=float("inf"), timeout=600.0, concurrency=[concurrency],
    )  # fmt: skip


def wait_ready(base_url: str, replicas: int) -> None:
    """Until /health is 200 and `replicas` replicas report ready."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            info = httpx.get(f"{base_url}/server_info", timeout=10).json()
            ready = sum(r.get("state") == "ready" for r in info.get("replicas", []))
            if httpx.get(f"{base_url}/health", timeout=10).status_code == 200 and ready == replicas:
                return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{replicas} replica(s) not ready after {READY_TIMEOUT_S} s")


def ray_passes(args: argparse.Namespace, output: str) -> dict[str, Report]:
    """The Ray Serve passes: 1 and 2 replicas on a two-node cluster of 1 CPU per node."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from diffserve.configs.demo_model import demo_model_path
    from diffserve.deploy.app import build_app

    memory = 80 * 2**20
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": memory, "include_dashboard": False},
    )
    reports: dict[str, Report] = {}
    try:
        nodes.add_node(num_cpus=1, object_store_memory=memory)
        ray.init(address=nodes.address, log_to_driver=False)
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        for replicas in (1, 2):
            model = {"model_path": str(demo_model_path()), "num_replicas": replicas, "engine_args": {"cpu_threads": 1}}  # fmt: skip
            server = {"output_path": output, "log_level": "warning", "max_queue_size": 4096}
            serve.run(build_app({"models": [model], "server": server}), name=APP, route_prefix="/")
            wait_ready(base_url, replicas)
            load = load_args(args, base_url, args.num_requests, args.concurrency)
            reports[f"ray {replicas}"] = asyncio.run(run(load))
            if replicas == 1:
                reports["ray 1 latency"] = asyncio.run(
                    run(load_args(args, base_url, args.latency_requests, 1))
                )
            serve.delete(APP)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            nodes.shutdown()
    return reports


def direct_passes(args: argparse.Namespace, output: str) -> dict[str, Report]:
    """A direct `diffserve serve` with the replicas' engine flags: one request at a time, and the load."""
    from diffserve.configs.demo_model import demo_model_path
    from diffserve.configs.engine_args import EngineArgs

    log = Path(output) / "direct-serve.log"
    flags = ["--cpu-threads", "1", "--log-level", "warning"]
    slots = EngineArgs(model_path="").max_running_requests  # the replicas' (the engine's default)
    with LaunchedServer(str(demo_model_path()), slots, flags, log) as server:
        latency = asyncio.run(run(load_args(args, server.base_url, args.latency_requests, 1)))
        load = asyncio.run(run(load_args(args, server.base_url, args.num_requests, args.concurrency)))
    return {"direct latency": latency, "direct": load}


def print_table(args: argparse.Namespace, r: dict[str, Report]) -> None:
    one, two = r["ray 1"], r["ray 2"]
    p50 = {key: r[key].latency_s.get("p50", float("nan")) for key in ("ray 1 latency", "direct latency")}
    print(
        f"\n{args.num_requests} requests at concurrency {args.concurrency}, 64x64, {args.steps} steps, demo model"
    )
    print("\n| setup | requests/s | p50 latency | p90 latency | failed | vs 1 replica |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [("Ray Serve, 1 replica", one), ("Ray Serve, 2 replicas on 2 nodes", two), ("direct `diffserve serve`", r["direct"])]  # fmt: skip
    for name, report in rows:
        speed = report.requests_per_s / one.requests_per_s
        print(
            f"| {name} | {report.requests_per_s:.2f} | {report.latency_s.get('p50', 0):.2f} s | "
            f"{report.latency_s.get('p90', 0):.2f} s | {report.failed} | {speed:.2f}x |"
        )
    overhead = p50["ray 1 latency"] / p50["direct latency"] - 1
    print(f"\nOne request at a time ({args.latency_requests} requests), p50 latency:")
    print("\n| path | p50 | p90 |\n|---|---:|---:|")
    for name, key in (
        ("Ray Serve, 1 replica", "ray 1 latency"),
        ("direct `diffserve serve`", "direct latency"),
    ):
        print(
            f"| {name} | {r[key].latency_s['p50'] * 1000:.0f} ms | {r[key].latency_s['p90'] * 1000:.0f} ms |"
        )
    print(f"\n2 replicas / 1 replica throughput: {two.requests_per_s / one.requests_per_s:.2f}x; "
          f"Ray path p50 overhead over direct serve: {overhead * 100:+.1f}%")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--num-requests", type=int, default=64, help="requests per throughput pass (default 64)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per request (default 20)")
    parser.add_argument(
        "--latency-requests", type=int, default=32, help="one-at-a-time requests (default 32)"
    )
    parser.add_argument("--prompt", default="a large red circle in the center on a black background")
    parser.add_argument("--json", type=Path, default=None, help="write the reports to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as output:
        reports = ray_passes(args, output)
        reports.update(direct_passes(args, output))
    print_table(args, reports)
    if args.json is not None:
        args.json.write_text(json.dumps({k: asdict(v) for k, v in reports.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
