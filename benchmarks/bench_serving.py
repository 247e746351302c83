"""Load generator for OpenAI-compatible image servers (diffserve serve, or any other), and baselines.

    # a server that is already running
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-requests 32 --concurrency 8 \\
        --size 256x256 --steps 4
    # start `diffserve serve` itself (batched, or one request at a time), run, stop it
    python benchmarks/bench_serving.py --launch MODEL_DIR --max-running-requests 1 --concurrency 1,4,8
    # diffusers' FluxPipeline, one request after another in one process (the same metrics, no HTTP)
    python benchmarks/bench_serving.py --diffusers MODEL_DIR --concurrency 1,4,8
    # all three at concurrency 1, 4 and 8, as a Markdown table (demo | flux-small | a model folder)
    python benchmarks/bench_serving.py --matrix demo

Sends `POST {base-url}/v1/images/generations` requests, at most `--concurrency` at a time (a list runs one
pass per value), arriving as a Poisson process at `--request-rate` per second (default: all at once), and
reports throughput (requests/s, images/s), latency mean/p50/p90/p99/max and failures by cause. `--steps`
and the per-request seed are sent as `num_inference_steps` and `seed` (diffserve and SGLang extensions);
pass `--openai-only` for servers that reject fields outside OpenAI's schema.

`--diffusers` is the sequential baseline: the same request list (same prompt, size, steps, seeds and the
model folder's sampling defaults) through diffusers' `FluxPipeline` in this process, one generation at a
time on one worker thread, each image PNG-encoded and base64'd as a server would; a request's latency runs
from the moment its client slot sends it (as over HTTP) to its encoded images, so queueing is included.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

#: `--matrix` modes: label -> how the requests are served.
MATRIX_MODES = ("diffserve batched", "diffserve --max-running-requests 1", "diffusers sequential")
SERVER_START_TIMEOUT_S = 900


@dataclass
class Result:
    ok: bool
    latency: float
    images: int
    failure: str | None = None


@dataclass
class Report:
    base_url: str  # or "diffusers:MODEL_DIR" for the in-process baseline
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


async def drive(
    args: argparse.Namespace, concurrency: int, send: Callable[[int], Awaitable[Result]]
) -> tuple[list[Result], float]:
    """`--warmup` untimed requests, then `--num-requests` timed ones, at most `concurrency` in flight."""
    for i in range(args.warmup):
        warm = await send(args.num_requests + i)
        if not warm.ok:
            print(f"warm-up request failed: {warm.failure}", file=sys.stderr)
    semaphore = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed)

    async def limited(index: int) -> Result:
        async with semaphore:
            return await send(index)

    tasks = []
    start = time.perf_counter()
    for i in range(args.num_requests):
        tasks.append(asyncio.create_task(limited(i)))
        if math.isfinite(args.request_rate) and i + 1 < args.num_requests:
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def run(args: argparse.Namespace, concurrency: int | None = None) -> Report:
    """One pass against the server at `--base-url`."""
    concurrency = concurrency or args.concurrency[0]
    url = args.base_url.rstrip("/") + "/v1/images/generations"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as http:
        results, duration = await drive(
            args, concurrency, lambda i: one_request(http, url, build_body(args, i))
        )
    return make_report(args, args.base_url, concurrency, results, duration)


def make_report(
    args: argparse.Namespace, target: str, concurrency: int, results: list[Result], duration: float
) -> Report:
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
        base_url=target,
        num_requests=args.num_requests,
        concurrency=concurrency,
        request_rate=None if math.isinf(args.request_rate) else args.request_rate,
        size=args.size,
        steps=args.steps,
        n=args.n,
        duration_s=duration,
        succeeded=len(ok),
        failed=len(results) - len(ok),
        images=images,
        requests_per_s=len(ok) / duration,
        images_per_s=images / duration,
        latency_s=latency,
        failures=dict(Counter(r.failure for r in results if not r.ok)),
    )


# -- the diffusers sequential baseline -------------------------------------------------------------
def diffusers_call_kwargs(model_dir: str) -> dict:
    """The sampling defaults diffserve applies to this folder (FLUX family defaults + its diffserve.json),
    as FluxPipeline.__call__ keywords, so both engines run the same requests."""
    from diffserve.families.flux.config import flux_default_sampling_params
    from diffserve.loader.folder_defaults import apply_overrides, read_folder_sampling_defaults

    p = apply_overrides(flux_default_sampling_params(), read_folder_sampling_defaults(Path(model_dir)))
    kwargs = {
        "true_cfg_scale": p.true_cfg_scale,
        "max_sequence_length": p.max_sequence_length,
        "num_inference_steps": p.num_inference_steps,
        "height": p.height,
        "width": p.width,
    }
    if p.guidance_scale is not None:
        kwargs["guidance_scale"] = p.guidance_scale
    if p.negative_prompt is not None:
        kwargs["negative_prompt"] = p.negative_prompt
    return {k: v for k, v in kwargs.items() if v is not None}


def load_diffusers(model_dir: str):
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


async def run_diffusers(args: argparse.Namespace, pipe, concurrency: int) -> Report:
    """One pass of the sequential baseline (see the module docstring)."""
    import torch

    kwargs = diffusers_call_kwargs(args.diffusers)
    if args.size != "auto":
        width, height = (int(v) for v in args.size.lower().split("x"))
        kwargs.update(width=width, height=height)
    if args.steps is not None:
        kwargs["num_inference_steps"] = args.steps
    worker = ThreadPoolExecutor(max_workers=1)  # one generation at a time, in arrival order

    def generate(index: int) -> int:
        generator = torch.Generator("cpu").manual_seed(args.seed + index)
        images = pipe(args.prompt, num_images_per_prompt=args.n, generator=generator, **kwargs).images
        for image in images:  # what a server does before answering
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            base64.b64encode(buffer.getvalue())
        return len(images)

    async def send(index: int) -> Result:
        start = time.perf_counter()
        try:
            images = await asyncio.get_running_loop().run_in_executor(worker, generate, index)
        except Exception as exc:
            return Result(False, time.perf_counter() - start, 0, type(exc).__name__)
        return Result(True, time.perf_counter() - start, images)

    try:
        results, duration = await drive(args, concurrency, send)
    finally:
        worker.shutdown()
    return make_report(args, f"diffusers:{args.diffusers}", concurrency, results, duration)


# -- starting diffserve serve --------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`diffserve serve` in a subprocess on a free port, stopped (SIGTERM) on exit."""

    def __init__(self, model_dir: str, max_running_requests: int, extra: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.output_dir = tempfile.mkdtemp(prefix="bench-serving-")
        cmd = [
            sys.executable,
            "-m",
            "diffserve.cli.main",
            "serve",
            "--model-path",
            model_dir,
            "--port",
            str(self.port),
            "--max-running-requests",
            str(max_running_requests),
            "--max-queue-size",
            "4096",
            "--output-path",
            self.output_dir,
            *extra,
        ]
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> LaunchedServer:
        try:  # stopped while waiting (Ctrl-C, SIGTERM, a timeout): the server goes too
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"diffserve serve exited with {self.process.returncode}; see {self.log_path}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"diffserve serve did not become ready in {SERVER_START_TIMEOUT_S} s; see {self.log_path}"
        )

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def resolve_model(name: str, model_dir: str | None) -> str:
    """`demo`: the shipped demo model; `flux-small`: bench_flux_vs_diffusers.py's checkpoint (built in
    `model_dir`, default a temporary folder); anything else: a model folder."""
    if name == "demo":
        from diffserve.configs.demo_model import demo_model_path

        return str(demo_model_path())
    if name == "flux-small":
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_flux_vs_diffusers import checkpoint_spec
        from diffserve.families.flux.tiny import build_tiny_flux

        root = Path(model_dir or tempfile.mkdtemp(prefix="bench-serving-flux-small-"))
        if not (root / "model_index.json").is_file():
            build_tiny_flux(root, checkpoint_spec())
        return str(root)
    return name


def run_matrix(args: argparse.Namespace) -> list[tuple[str, Report]]:
    """Every mode at every concurrency on one model: diffserve batched and one-at-a-time (a server each),
    then diffusers sequential (in a subprocess, so its torch does not share this process)."""
    model = resolve_model(args.matrix, args.model_dir)
    rows: list[tuple[str, Report]] = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serving-logs-"))
    for mode, running in ((MATRIX_MODES[0], args.max_running_requests), (MATRIX_MODES[1], 1)):
        print(f"== {mode} ({model})", flush=True)
        with LaunchedServer(model, running, args.server_arg, log_dir / f"server-{running}.log") as server:
            args.base_url = server.base_url
            for c in args.concurrency:
                report = asyncio.run(run(args, c))
                print_report(report)
                rows.append((mode, report))
    print(f"== {MATRIX_MODES[2]} ({model})", flush=True)
    out = log_dir / "diffusers.json"
    cmd = [sys.executable, __file__, "--diffusers", model, "--output-json", str(out), *_shared_flags(args)]
    subprocess.run(cmd, check=False)
    if out.is_file():
        rows += [(MATRIX_MODES[2], Report(**r)) for r in json.loads(out.read_text())]
    return rows


def _shared_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--num-requests",
        str(args.num_requests),
        "--concurrency",
        ",".join(map(str, args.concurrency)),
        "--size",
        args.size,
        "--n",
        str(args.n),
        "--prompt",
        args.prompt,
        "--seed",
        str(args.seed),
        "--warmup",
        str(args.warmup),
    ]
    if args.steps is not None:
        flags += ["--steps", str(args.steps)]
    if math.isfinite(args.request_rate):
        flags += ["--request-rate", str(args.request_rate)]
    return flags


def print_table(rows: list[tuple[str, Report]], title: str) -> None:
    print(f"\n### {title}\n")
    print("| mode | concurrency | requests/s | images/s | p50 latency s | p99 latency s | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in rows:
        lat = r.latency_s or {"p50": math.nan, "p99": math.nan}
        print(
            f"| {mode} | {r.concurrency} | {r.requests_per_s:.3f} | {r.images_per_s:.3f} | {lat['p50']:.3f} | "
            f"{lat['p99']:.3f} | {r.failed} |"
        )


def print_report(report: Report) -> None:
    rate = "inf" if report.request_rate is None else f"{report.request_rate:g}/s"
    print(f"Server:          {report.base_url}")
    print(
        f"Requests:        {report.num_requests} (concurrency {report.concurrency}, arrival rate {rate}, "
        f"size {report.size}, steps {report.steps if report.steps is not None else 'server default'}, "
        f"n {report.n})"
    )
    print(f"Duration:        {report.duration_s:.2f} s")
    print(f"Succeeded:       {report.succeeded}   Failed: {report.failed}")
    print(f"Throughput:      {report.requests_per_s:.3f} requests/s, {report.images_per_s:.3f} images/s")
    if report.latency_s:
        lat = report.latency_s
        print(
            f"Latency (s):     mean {lat['mean']:.3f}  p50 {lat['p50']:.3f}  p90 {lat['p90']:.3f}  "
            f"p99 {lat['p99']:.3f}  max {lat['max']:.3f}"
        )
    for cause, count in sorted(report.failures.items()):
        print(f"Failure:         {count} x {cause}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument(
        "--launch",
        metavar="MODEL_DIR",
        default=None,
        help="start `diffserve serve --model-path MODEL_DIR` on a free port, benchmark it, stop it",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=8,
        help="with --launch / --matrix: the server's --max-running-requests (1: one at a time)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for the launched server (repeat; e.g. --server-arg=--dtype=bfloat16)",
    )
    p.add_argument(
        "--diffusers",
        metavar="MODEL_DIR",
        default=None,
        help="the sequential baseline: diffusers' FluxPipeline on MODEL_DIR in this process",
    )
    p.add_argument(
        "--matrix",
        metavar="MODEL",
        default=None,
        help="diffserve batched, diffserve --max-running-requests 1 and diffusers sequential at "
        "every --concurrency (default 1,4,8) on MODEL: demo, flux-small or a model folder",
    )
    p.add_argument("--model-dir", default=None, help="with --matrix flux-small: where to build/reuse it")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument(
        "--concurrency",
        default=None,
        help="requests in flight at most; a comma list runs one pass each (default: 8; 1,4,8 with --matrix)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean arrivals per second (Poisson); default inf: all at once, limited by --concurrency",
    )
    p.add_argument("--size", default="256x256", help="'WIDTHxHEIGHT' or 'auto'")
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the server's)")
    p.add_argument("--n", type=int, default=1, help="images per request")
    p.add_argument("--model", default=None, help="'model' field (default: omitted, the server's model)")
    p.add_argument("--prompt", default="a photo of a red fox in the snow")
    p.add_argument("--response-format", default="b64_json", choices=["b64_json", "url"])
    p.add_argument(
        "--seed", type=int, default=0, help="request i uses seed + i; also seeds the arrival times"
    )
    p.add_argument("--openai-only", action="store_true", help="send only OpenAI's fields (no steps, no seed)")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("DIFFSERVE_API_KEY")
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed requests sent first")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    try:
        args.concurrency = [
            int(c) for c in (args.concurrency or ("1,4,8" if args.matrix else "8")).split(",")
        ]
    except ValueError:
        p.error(f"--concurrency must be an integer or a comma list of integers, got {args.concurrency!r}")
    if sum(x is not None for x in (args.launch, args.diffusers, args.matrix)) > 1:
        p.error("pass at most one of --launch, --diffusers and --matrix")
    if args.num_requests < 1 or min(args.concurrency) < 1 or args.n < 1:
        p.error("--num-requests, --concurrency and --n must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (`kill`, `timeout`) unwinds like Ctrl-C, so a launched server is stopped on the way out."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    if args.matrix:
        rows = run_matrix(args)
        print_table(
            rows,
            f"{args.matrix}: {args.num_requests} requests, size {args.size}, steps "
            f"{args.steps if args.steps is not None else 'default'}, n {args.n}",
        )
        reports = [r for _, r in rows]
    elif args.diffusers:
        pipe = load_diffusers(args.diffusers)
        reports = [asyncio.run(run_diffusers(args, pipe, c)) for c in args.concurrency]
    elif args.launch:
        log = Path(tempfile.mkdtemp(prefix="bench-serving-logs-")) / "server.log"
        with LaunchedServer(args.launch, args.max_running_requests, args.server_arg, log) as server:
            args.base_url = server.base_url
            reports = [asyncio.run(run(args, c)) for c in args.concurrency]
    else:
        reports = [asyncio.run(run(args, c)) for c in args.concurrency]
    if not args.matrix:
        for report in reports:
            print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            data = [asdict(r) for r in reports]
            json.dump(
                data[0] if len(data) == 1 and not (args.matrix or args.diffusers) else data, f, indent=2
            )
    return 0 if all(r.failed == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
