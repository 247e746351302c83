"""Prometheus metrics of the server, in a registry of their own (served by GET /metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from diffserve.server.protocol import JobFinished

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ReplicaLoad(Protocol):
    """What the per-replica gauges read of one replica (an `EngineClient`)."""

    replica: int

    @property
    def ready(self) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        latency = {"buckets": _LATENCY_BUCKETS, "registry": r}
        self.http_requests = Counter(
            "diffserve_http_requests", "HTTP requests by method, route and status code",
            ["method", "route", "status"], registry=r,
        )  # fmt: skip
        self.generation_requests = Counter(
            "diffserve_generation_requests",
            "Generation requests (images and video jobs) by outcome: success, invalid, queue_full, "
            "unavailable, failed, cancelled",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge("diffserve_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("diffserve_running_requests", "Requests the engine is running", registry=r)
        self.engine_ready = Gauge("diffserve_engine_ready", "1 when the engine accepts requests", registry=r)
        replica = {"labelnames": ["replica"], "registry": r}
        self.replica_queue_depth = Gauge(
            "diffserve_replica_queue_depth",
            "Requests waiting for one replica's engine (--dp-size)",
            **replica,
        )
        self.replica_running = Gauge(
            "diffserve_replica_running_requests", "Requests one replica's engine is running", **replica
        )
        self.replica_up = Gauge(
            "diffserve_replica_engine_up", "1 when the replica's engine accepts requests", **replica
        )
        self.engine_restarts = Counter(
            "diffserve_engine_restarts", "Engine restarts after a crash", registry=r
        )
        self.request_latency = Histogram(
            "diffserve_request_latency_seconds", "Successful generation requests, arrival to response", **latency
        )  # fmt: skip
        self.queue_time = Histogram(
            "diffserve_queue_time_seconds", "Time requests waited before the engine started them", **latency
        )
        self.stage_seconds = Histogram(
            "diffserve_stage_seconds", "Time per pipeline stage", ["stage"], **latency
        )
        self.step_seconds = Histogram(
            "diffserve_step_seconds", "Time per denoising step", buckets=_STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "diffserve_batch_size",
            "Requests sharing the DiT batch of a denoising step, observed once per request per step (the "
            "share of requests' steps that ran batched)",
            buckets=_BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_seconds_per_row = Gauge(
            "diffserve_dit_step_seconds_per_row",
            "The batch policy's measured curve: median seconds of a DiT step per batch row, by token bucket (a "
            "request's latent tokens, rounded up to a power of two) and rows in the batch (as last reported)",
            ["bucket", "rows"], registry=r,
        )  # fmt: skip
        self.batch_policy = Gauge(
            "diffserve_batch_policy",
            "The engine's --batch-policy (1 for the one in use)",
            ["policy"],
            registry=r,
        )
        self.images_generated = Counter(
            "diffserve_images_generated", "Images returned to clients", registry=r
        )
        self.videos_generated = Counter("diffserve_videos_generated", "Videos of /v1/videos jobs", registry=r)
        self.dit_blocks = Counter(
            "diffserve_dit_blocks",
            "DiT block evaluations of requests with a cache method or an approximate quality tier, by whether "
            "they were computed or reused from an earlier step (reused: the DiT work saved)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.dit_steps = Counter(
            "diffserve_dit_cached_steps",
            "Denoising steps of requests with a cache method or an approximate quality tier, by whether their "
            "cached blocks were computed or reused",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.peak_memory = Gauge(
            "diffserve_peak_memory_bytes", "Peak memory of the last request (device memory; process RSS on CPU)",
            registry=r,
        )  # fmt: skip
        self.max_peak_memory = Gauge(
            "diffserve_peak_memory_max_bytes", "Highest peak memory of any request since start", registry=r
        )
        self._max_peak = 0

    def track_replicas(self, replicas: Sequence[ReplicaLoad]) -> None:
        """Per-replica gauges, read at each scrape; one label value per replica (bounded by --dp-size)."""
        for rep in replicas:
            label = str(rep.replica)
            self.replica_queue_depth.labels(label).set_function(lambda rep=rep: rep.num_waiting)
            self.replica_running.labels(label).set_function(lambda rep=rep: rep.num_running)
            self.replica_up.labels(label).set_function(lambda rep=rep: float(rep.ready))

    def count(self, outcome: str) -> None:
        """One generation request's outcome (`diffserve_generation_requests_total`)."""
        self.generation_requests.labels(outcome).inc()

    def observe_finished(self, result: JobFinished, latency: float) -> None:
        """A successful generation request: its outcome, latency and what the engine reported."""
        self.count("success")
        self.request_latency.observe(latency)
        self.images_generated.inc(len(result.images))
        self.videos_generated.inc(len(result.videos))
        for stage, seconds in result.timings.items():
            self.stage_seconds.labels(stage).observe(seconds)
        for seconds in result.step_times:
            self.step_seconds.observe(seconds)
        for size in result.batch_sizes:
            self.batch_size.observe(size)
        if result.batching is not None:
            self.observe_batching(result.batching)
        if result.cache is not None:
            self.dit_blocks.labels("computed").inc(result.cache["blocks_computed"])
            self.dit_blocks.labels("reused").inc(result.cache["blocks_reused"])
            self.dit_steps.labels("computed").inc(result.cache["steps_computed"])
            self.dit_steps.labels("reused").inc(result.cache["steps_reused"])
        if result.peak_memory_bytes is not None:
            self.peak_memory.set(result.peak_memory_bytes)
            self._max_peak = max(self._max_peak, result.peak_memory_bytes)
            self.max_peak_memory.set(self._max_peak)

    def observe_batching(self, batching: dict[str, Any]) -> None:
        """The batch policy and its curve (`BatchPolicy.describe`); labels are bounded by the token buckets
        (powers of two) and batch rows the engine can run."""
        self.batch_policy.labels(batching["policy"]).set(1)
        for bucket, by_rows in batching["step_seconds"].items():
            for rows, point in by_rows.items():
                self.step_seconds_per_row.labels(bucket, rows).set(point["seconds_per_row"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
