"""diffserve on Ray Serve (issue 32), side by side in one run on the shipped demo model:

1. throughput: 1 replica against 2 replicas on 2 Ray nodes of 1 CPU each (`ray.cluster_utils.Cluster` on
   the loopback: a head and a worker node), `--num-requests` requests at `--concurrency`, torch on one
   thread per replica (`--cpu-threads 1`, in Ray's 1-CPU workers);
2. what the Ray path costs: the latency of one request at a time through Ray Serve (proxy, ingress,
   replica, engine) at 1 replica against a direct `diffserve serve` with the same engine flags, both
   running at once and the requests alternating between them (paired: the machine's load drifts alike
   for both); the direct server's throughput under the same load is printed too, for reference.

    .venv/bin/python benchmarks/bench_ray.py                       # 64 requests at concurrency 8
    .venv/bin/python benchmarks/bench_ray.py --num-requests 16 --steps 8 --latency-requests 8   # quick

The load is bench_serving.py's (same request bodies: prompt, 64x64, `--steps`, a seed per request).
Prints Markdown tables; `--json PATH` writes the figures. Needs the extra: pip install "diffserve[ray]".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import LaunchedServer, Report, free_port, percentile, run  # noqa: E402

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


def direct_server(output: str) -> LaunchedServer:
    """`diffserve serve` on the demo model with the replicas' engine flags."""
    from diffserve.configs.demo_model import demo_model_path
    from diffserve.configs.engine_args import EngineArgs

    flags = ["--cpu-threads", "1", "--log-level", "warning"]
    slots = EngineArgs(model_path="").max_running_requests  # the replicas' (the engine's default)
    return LaunchedServer(str(demo_model_path()), slots, flags, Path(output) / "direct-serve.log")


def paired_latency(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """One request at a time, alternating between the servers (the order swapped every round): each
    one's latency p50/p90/mean in seconds, after two warm-up requests each."""
    seconds: dict[str, list[float]] = {name: [] for name in urls}
    names = list(urls)
    with httpx.Client(timeout=600) as http:
        for index in range(-2, args.latency_requests):
            body = {
                "prompt": args.prompt,
                "size": "64x64",
                "seed": max(index, 0),
                "num_inference_steps": args.steps,
            }
            for name in names if index % 2 else reversed(names):
                start = time.perf_counter()
                response = http.post(f"{urls[name]}/v1/images/generations", json=body)
                elapsed = time.perf_counter() - start
                response.raise_for_status()
                if index >= 0:
                    seconds[name].append(elapsed)
    return {
        name: {"p50": percentile(v, 50), "p90": percentile(v, 90), "mean": statistics.fmean(v)}
        for name, v in seconds.items()
    }


def measure(args: argparse.Namespace, output: str) -> dict[str, Any]:
    """Every figure: the Ray passes on a two-node cluster of 1 CPU per node, and the direct server."""
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
    figures: dict[str, Any] = {}
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
            figures[f"ray {replicas}"] = asyncio.run(
                run(load_args(args, base_url, args.num_requests, args.concurrency))
            )
            if replicas == 1:
                with direct_server(output) as direct:
                    urls = {"ray": base_url, "direct": direct.base_url}
                    figures["latency"] = paired_latency(args, urls)
            serve.delete(APP)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            nodes.shutdown()
    with direct_server(output) as direct:  # the reference load, alone on the machine
        figures["direct"] = asyncio.run(
            run(load_args(args, direct.base_url, args.num_requests, args.concurrency))
        )
    return figures


def print_tables(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    one: Report = figures["ray 1"]
    print(
        f"\n{args.num_requests} requests at concurrency {args.concurrency}, 64x64, {args.steps} steps, demo model:"
    )
    print(
        "\n| setup | requests/s | p50 latency | p90 latency | failed | vs 1 replica |\n|---|---:|---:|---:|---:|---:|"
    )
    rows = [("Ray Serve, 1 replica", figures["ray 1"]), ("Ray Serve, 2 replicas on 2 nodes", figures["ray 2"]),
            ("direct `diffserve serve` (reference)", figures["direct"])]  # fmt: skip
    for name, report in rows:
        print(
            f"| {name} | {report.requests_per_s:.2f} | {report.latency_s.get('p50', 0):.2f} s | "
            f"{report.latency_s.get('p90', 0):.2f} s | {report.failed} | {report.requests_per_s / one.requests_per_s:.2f}x |"
        )  # fmt: skip
    latency = figures["latency"]
    print(f"\nOne request at a time, {args.latency_requests} each, alternating between the two:")
    print("\n| path | p50 | p90 | mean |\n|---|---:|---:|---:|")
    for name, key in (("Ray Serve, 1 replica", "ray"), ("direct `diffserve serve`", "direct")):
        row = latency[key]
        print(
            f"| {name} | {row['p50'] * 1000:.0f} ms | {row['p90'] * 1000:.0f} ms | {row['mean'] * 1000:.0f} ms |"
        )
    speedup = figures["ray 2"].requests_per_s / one.requests_per_s
    overhead = latency["ray"]["p50"] / latency["direct"]["p50"] - 1
    print(
        f"\n2 replicas / 1 replica throughput: {speedup:.2f}x; Ray path p50 over direct serve: {overhead * 100:+.1f}%"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--num-requests", type=int, default=64, help="requests per throughput pass (default 64)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per request (default 20)")
    parser.add_argument("--latency-requests", type=int, default=32, help="one-at-a-time requests per path (default 32)")  # fmt: skip
    parser.add_argument("--prompt", default="a large red circle in the center on a black background")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as output:
        figures = measure(args, output)
    print_tables(args, figures)
    if args.json is not None:
        plain = {k: asdict(v) if isinstance(v, Report) else v for k, v in figures.items()}
        args.json.write_text(json.dumps(plain, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
