"""`StepScheduler`: what runs next, decided at every denoising step boundary; it never calls a model.
Admission follows queue order (`priority`, then arrival) within the running set's limits; a head that
does not fit blocks the queue (large requests are not starved); an empty running set always admits.
Requests with equal `batch_key`s may share a DiT batch, each at its own step; how many do is the batch
policy's choice (runtime/batch_policy.py: `throughput` batches a whole group and groups take turns
round-robin; `latency` and `auto` serve the first request in shortest-remaining order, `auto` with as many
of its group as the measured step times say pays). `add`/`cancel` work from any thread; decisions are made
on the engine's driving thread."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

from diffserve.phases import WHOLE, PhaseSpan
from diffserve.request import Req
from diffserve.runtime.batch_policy import BATCH_POLICIES, BatchPolicy, Candidate, step_order, token_bucket
from diffserve.runtime.memory import MemoryModel, RequestCost


def default_max_batch_tokens(device_type: str) -> int:
    """--max-batch-tokens when unset: 8 1024x1024 FLUX requests with CFG; less on CPU (only adds latency)."""
    return 16384 if device_type == "cpu" else 65536


@dataclass
class SchedulerConfig:
    """Limits (None: no limit): requests running at once; the running set's latent tokens x CFG branches x
    outputs; denoising steps one request may ask for (`Engine.prepare` refuses more); and the batch policy
    (runtime/batch_policy.py: how many running requests share a step)."""

    max_running_requests: int = 8
    max_batch_tokens: int | None = None
    max_inference_steps: int | None = 1000
    batch_policy: str = "auto"

    def __post_init__(self) -> None:
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(
                f"batch_policy must be one of {', '.join(BATCH_POLICIES)}, got {self.batch_policy!r}"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_inference_steps is not None and self.max_inference_steps < 1:
            raise ValueError(f"max_inference_steps must be >= 1, got {self.max_inference_steps}")


@dataclass(eq=False)
class ScheduledRequest:
    """A request in the engine, with what admission needs to know about it and how it ended (`done`: set
    once it has ended and its events were sent; `payload`: the caller's own object)."""

    req: Req
    cost: RequestCost
    priority: int = 0  # higher runs first; equal priorities run in arrival order
    seq: int = 0
    payload: object | None = None
    #: The phases this engine runs for it (phases.py): all of them unless it arrived or leaves as a hand-off.
    span: PhaseSpan = WHOLE
    state: Literal["waiting", "running", "finished", "cancelled", "failed"] = "waiting"
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    batch_sizes: list[int] = field(default_factory=list)  # DiT batch size of each of its steps
    skipped_steps: int = 0  # steps it could have run but the batch policy passed it over (ageing)
    peak_memory_bytes: int | None = None  # the platform's, since the running set was last empty
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def cancel_event(self) -> threading.Event:
        assert self.req.cancel_event is not None
        return self.req.cancel_event

    @property
    def order(self) -> tuple[int, int]:
        return (-self.priority, self.seq)

    @property
    def rows(self) -> int:
        """Its rows in a DiT batch: CFG branches x outputs."""
        return self.cost.branches * self.cost.outputs

    @property
    def token_bucket(self) -> int:
        return token_bucket(self.cost.tokens)

    def candidate(self) -> Candidate:
        remaining = self.req.num_steps - self.req.step_index if self.req.schedule is not None else 0
        return Candidate(self.rows, remaining, self.priority, self.seq, self.skipped_steps)


class StepScheduler:
    def __init__(self, config: SchedulerConfig | None = None, memory: MemoryModel | None = None) -> None:
        """`memory`: None admits without a memory check."""
        self.config = config or SchedulerConfig()
        self.memory = memory
        self.policy = BatchPolicy(self.config.batch_policy)
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._waiting: list[ScheduledRequest] = []  # kept sorted by `order`
        self._running: list[ScheduledRequest] = []  # in admission order
        self._rotation: deque[Hashable] = deque()  # batch keys, least recently served first
        # Statistics (tests, logs, /server_info): steps run per batch key, DiT batches by size.
        self.steps_per_group: Counter[Hashable] = Counter()
        self.batch_size_counts: Counter[int] = Counter()
        self.max_running_seen = 0

    def reserve_seq(self) -> int:
        """An arrival number for a request `add`ed later: the server's engine numbers a job when it
        receives it, then admits it on another thread, so it keeps its place among equal priorities
        however long its admission takes."""
        with self._cond:
            return next(self._seq)

    def add(self, sr: ScheduledRequest, seq: int | None = None) -> ScheduledRequest:
        """Queue `sr`, in arrival order among equal priorities: now, or `seq` from `reserve_seq`."""
        with self._cond:
            sr.seq = next(self._seq) if seq is None else seq
            sr.state = "waiting"
            self._waiting.append(sr)
            self._waiting.sort(key=lambda s: s.order)
            self._cond.notify_all()
        return sr

    def cancel(self, request_id: str) -> tuple[Literal["waiting", "running"], ScheduledRequest] | None:
        """Drop a waiting request (returned for the caller to report), or flag a running one (it leaves at
        the next step boundary); None when it is not here."""
        with self._cond:
            for sr in self._waiting:
                if sr.request_id == request_id:
                    self._waiting.remove(sr)
                    sr.state = "cancelled"
                    sr.cancel_event.set()
                    return "waiting", sr
            for sr in self._running:
                if sr.request_id == request_id:
                    sr.cancel_event.set()
                    return "running", sr
        return None

    def cancel_all(self) -> list[ScheduledRequest]:
        """Drop every waiting request (returned) and flag every running one."""
        with self._cond:
            dropped, self._waiting = self._waiting, []
            for sr in dropped:
                sr.state = "cancelled"
                sr.cancel_event.set()
            for sr in self._running:
                sr.cancel_event.set()
            return dropped

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def running_costs(self) -> list[RequestCost]:
        """The costs of the requests in the running set (automatic VAE tiling weighs a decode against them)."""
        with self._cond:
            return [sr.cost for sr in self._running]

    def running_tokens(self) -> int:
        with self._cond:
            return sum(sr.cost.batch_tokens for sr in self._running)

    def wait_for_work(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.has_work, timeout)

    def take_cancelled(self) -> list[ScheduledRequest]:
        """Running requests whose cancel flag is set, removed from the running set."""
        with self._cond:
            dropped = [sr for sr in self._running if sr.req.cancelled]
            for sr in dropped:
                self._running.remove(sr)
                sr.state = "cancelled"
        return dropped

    def _fits(self, sr: ScheduledRequest) -> bool:
        running = self._running
        if not running:
            return True
        room = self.policy.running_room(sr.token_bucket)
        if room is not None:
            bucket = sr.token_bucket
            if sum(1 for r in running if r.token_bucket == bucket and not r.req.is_denoised) >= room:
                return False
        return self.within_limits([r.cost for r in running], sr.cost)

    def within_limits(self, running: list[RequestCost], cost: RequestCost) -> bool:
        """Whether a request of `cost` may run beside `running` under max_running_requests, max_batch_tokens
        and the memory model (the batch policy aside)."""
        if len(running) >= self.config.max_running_requests:
            return False
        limit = self.config.max_batch_tokens
        if limit is not None and sum(c.batch_tokens for c in running) + cost.batch_tokens > limit:
            return False
        return self.memory is None or self.memory.fits(running, cost)

    def admit(self, ready: Callable[[ScheduledRequest], bool] | None = None) -> list[ScheduledRequest]:
        """Waiting requests that start now (moved to the running set, in queue order). `ready`: whether a
        request's inputs are there (its LoRA adapters read); one that is not waits without blocking the
        requests behind it."""
        admitted: list[ScheduledRequest] = []
        with self._cond:
            waiting = [sr for sr in self._waiting if ready is None or ready(sr)]
            while waiting and self._fits(waiting[0]):
                sr = waiting.pop(0)
                self._waiting.remove(sr)
                sr.state = "running"
                sr.started_at = time.perf_counter()
                self._running.append(sr)
                admitted.append(sr)
            self.max_running_seen = max(self.max_running_seen, len(self._running))
        return admitted

    def next_group(
        self, batch_key: Callable[[Req], Hashable]
    ) -> tuple[list[ScheduledRequest], list[tuple[ScheduledRequest, Exception]]]:
        """The running requests that share the next DiT step (the batch policy's choice: see the module
        docstring), and the requests whose key could not be computed (the engine fails them)."""
        groups: dict[Hashable, list[ScheduledRequest]] = {}
        broken: list[tuple[ScheduledRequest, Exception]] = []
        with self._cond:
            running = [sr for sr in self._running if sr.state == "running" and not sr.req.is_denoised]
        for sr in running:
            try:
                key = batch_key(sr.req)
            except Exception as exc:
                broken.append((sr, exc))
                continue
            groups.setdefault(key, []).append(sr)
        if not groups:
            return [], broken
        if self.policy.name == "throughput":
            key = self._next_in_rotation(groups)
            group = groups[key]
        else:
            key, group = self._shortest_first(groups)
        self.steps_per_group[key] += 1
        for sr in running:
            if sr not in group:
                sr.skipped_steps += 1
        return group, broken

    def _next_in_rotation(self, groups: dict[Hashable, list[ScheduledRequest]]) -> Hashable:
        """The key whose turn it is, round-robin over the keys that have running requests."""
        for key in [k for k in self._rotation if k not in groups]:
            self._rotation.remove(key)
        for key in groups:
            if key not in self._rotation:
                self._rotation.append(key)
        key = self._rotation[0]
        self._rotation.rotate(-1)
        return key

    def _shortest_first(
        self, groups: dict[Hashable, list[ScheduledRequest]]
    ) -> tuple[Hashable, list[ScheduledRequest]]:
        """The group of the request first in `step_order`, cut to as many (in that order) as the policy
        chooses for their token bucket."""
        keyed = [(key, sr) for key, members in groups.items() for sr in members]
        ordered = [keyed[i] for i in step_order([sr.candidate() for _, sr in keyed])]
        key = ordered[0][0]
        members = [sr for k, sr in ordered if k == key]
        count = self.policy.choose(members[0].token_bucket, [sr.rows for sr in members])
        return key, members[:count]

    def step_samples(self, group: list[ScheduledRequest]) -> list[float]:
        """The list the time of `group`'s step goes to: the batch policy's curve at its bucket and rows."""
        return self.policy.curve.samples(group[0].token_bucket, sum(sr.rows for sr in group))

    def record_step(self, group: list[ScheduledRequest]) -> None:
        self.batch_size_counts[len(group)] += 1
        for sr in group:
            sr.batch_sizes.append(len(group))

    def remove(self, sr: ScheduledRequest) -> None:
        with self._cond:
            if sr in self._running:
                self._running.remove(sr)
