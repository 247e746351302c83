"""Load generator for OpenAI-compatible image servers (diffserve serve, or any other).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-requests 32 --concurrency 8 \\
        --size 256x256 --steps 4

Sends `POST {base-url}/v1/images/generations` requests, at most `--concurrency` at a time, arriving as a
Poisson process at `--request-rate` per second (default: all at once), and reports throughput
(requests/s, images/s), latency mean/p50/p90/p99/max and failures by cause. `--steps` and the per-request
seed are sent as `num_inference_steps` and `seed` (diffserve and SGLang extensions); pass `--openai-only`
for servers that reject fields outside OpenAI's schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class Result:
    ok: bool
    latency: float
    images: int
    failure: str | None = None


@dataclass
class Report:
    base_url: str
    num_requests: int
    concurrency: int
    request_rate: float | None  # None: all at once
    size: str
    steps: int | None
    n: int
    duration_s: float
    succeeded: int
    failed: int
    images: int
    requests_per_s: float
    images_per_s: float
    latency_s: dict[str, float]
    failures: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def build_body(args: argparse.Namespace, index: int) -> dict:
    body = {"prompt": args.prompt, "n": args.n, "size": args.size, "response_format": args.response_format}
    if args.model:
        body["model"] = args.model
    if not args.openai_only:
        body["seed"] = args.seed + index
        if args.steps is not None:
            body["num_inference_steps"] = args.steps
    return body


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> Result:
    start = time.perf_counter()
    try:
        response = await http.post(url, json=body)
    except httpx.HTTPError as exc:
        return Result(False, time.perf_counter() - start, 0, type(exc).__name__)
    latency = time.perf_counter() - start
    if response.status_code != 200:
        try:
            detail = response.json()["error"].get("code") or response.json()["error"]["type"]
        except (ValueError, KeyError, TypeError, AttributeError):
            detail = ""
        return Result(False, latency, 0, f"HTTP {response.status_code}" + (f" {detail}" if detail else ""))
    try:
        images = len(response.json()["data"])
    except (ValueError, KeyError, TypeError):
        return Result(False, latency, 0, "bad response body")
    if images != body["n"]:
        return Result(False, latency, images, f"expected {body['n']} images, got {images}")
    return Result(True, latency, images)


async def run(args: argparse.Namespace) -> Report:
    url = args.base_url.rstrip("/") + "/v1/images/generations"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as http:
        for i in range(args.warmup):
            warm = await one_request(http, url, build_body(args, args.num_requests + i))
            if not warm.ok:
                print(f"warm-up request failed: {warm.failure}", file=sys.stderr)
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(index: int) -> Result:
            async with semaphore:
                return await one_request(http, url, build_body(args, index))

        tasks = []
        start = time.perf_counter()
        for i in range(args.num_requests):
            tasks.append(asyncio.create_task(limited(i)))
            if math.isfinite(args.request_rate) and i + 1 < args.num_requests:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    latencies = [r.latency for r in ok]
    images = sum(r.images for r in ok)
    latency = {}
    if latencies:
        latency = {
            "mean": statistics.fmean(latencies),
            "p50": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "p99": percentile(latencies, 99),
            "max": max(latencies),
        }
    return Report(
        base_url=args.base_url, num_requests=args.num_requests, concurrency=args.concurrency,
        request_rate=None if math.isinf(args.request_rate) else args.request_rate,
        size=args.size, steps=args.steps, n=args.n, duration_s=duration,
        succeeded=len(ok), failed=len(results) - len(ok), images=images,
        requests_per_s=len(ok) / duration, images_per_s=images / duration, latency_s=latency,
        failures=dict(Counter(r.failure for r in results if not r.ok)),
    )


def print_report(report: Report) -> None:
    rate = "inf" if report.request_rate is None else f"{report.request_rate:g}/s"
    print(f"Server:          {report.base_url}")
    print(f"Requests:        {report.num_requests} (concurrency {report.concurrency}, arrival rate {rate}, "
          f"size {report.size}, steps {report.steps if report.steps is not None else 'server default'}, "
          f"n {report.n})")
    print(f"Duration:        {report.duration_s:.2f} s")
    print(f"Succeeded:       {report.succeeded}   Failed: {report.failed}")
    print(f"Throughput:      {report.requests_per_s:.3f} requests/s, {report.images_per_s:.3f} images/s")
    if report.latency_s:
        lat = report.latency_s
        print(f"Latency (s):     mean {lat['mean']:.3f}  p50 {lat['p50']:.3f}  p90 {lat['p90']:.3f}  "
              f"p99 {lat['p99']:.3f}  max {lat['max']:.3f}")
    for cause, count in sorted(report.failures.items()):
        print(f"Failure:         {count} x {cause}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second (Poisson); default inf: all at once, limited by --concurrency")
    p.add_argument("--size", default="256x256", help="'WIDTHxHEIGHT' or 'auto'")
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the server's)")
    p.add_argument("--n", type=int, default=1, help="images per request")
    p.add_argument("--model", default=None, help="'model' field (default: omitted, the server's model)")
    p.add_argument("--prompt", default="a photo of a red fox in the snow")
    p.add_argument("--response-format", default="b64_json", choices=["b64_json", "url"])
    p.add_argument("--seed", type=int, default=0, help="request i uses seed + i; also seeds the arrival times")
    p.add_argument("--openai-only", action="store_true", help="send only OpenAI's fields (no steps, no seed)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("DIFFSERVE_API_KEY"))
    p.add_argument("--warmup", type=int, default=1, help="untimed requests sent first")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.n < 1:
        p.error("--num-requests, --concurrency and --n must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0 if report.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
