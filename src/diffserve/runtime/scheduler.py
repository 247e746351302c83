"""`StepScheduler`: step-level continuous batching of diffusion requests.

A request goes through a pipeline's three phases (`pipeline.run_pre_denoise`, `denoise_step`,
`run_post_denoise`, see pipelines/base.py). The scheduler keeps a *waiting* queue and a *running* set and
makes its decisions at denoising step boundaries. One iteration (`step()`):

1. **Drop cancelled requests.** A running request whose `cancel_event` is set leaves the running set
   at once (its slot is free for the admission below); the others are untouched.
2. **Admit** waiting requests in queue order while the limits allow, and run their pre-denoise phase
   (validation, text encoding, initial latents). Queue order is `priority` first (higher first), then
   arrival (FCFS). The head of the queue is admitted only if, with it, the running set stays within
   `max_running_requests`, `max_batch_tokens` (sum of latent tokens x CFG branches x outputs of the
   running requests) and the memory model's budget; if it does not fit, nobody behind it is admitted
   either (no overtaking: a large request is never starved by a stream of small ones). A request is
   always admitted into an empty running set (it was checked against the memory budget at submission,
   and a token limit below one request's size must not stall the engine).
3. **One denoising step for one group.** Running requests are grouped by `pipeline.batch_key(req)`
   (requests whose inputs can be concatenated into one DiT batch: same latent grid and text shape);
   each request is at its own step, with its own sigmas, guidance, CFG and seed. Groups are served
   **round-robin**: the group that ran least recently goes next, so with two shapes in flight each gets
   every other step whatever their sizes (fair in steps, not in seconds). A new group joins the end of
   the rotation.
4. Every request of the group gets its step time and its `on_step(req)` call; the ones whose last step
   is done run their post-denoise phase (decoding) and complete.

The loop does not wait for the device between steps: a step's time is read from marks in the device's
work queue once the device has passed them (`platforms/step_timer.py`), and a request's remaining step
times are waited for once, when it completes. An asynchronous device error therefore surfaces at a later
step or at that completion rather than in the step that caused it.

Requests join at the next step boundary and leave as soon as their own steps are done: nobody waits for
a whole batch to finish. With `max_running_requests=1` this is exactly the one-request-at-a-time engine.

Failures are contained: an error in a request's own phase (pre- or post-denoise) fails that request;
an error inside a shared denoising step fails the requests of that group (logged), never the engine or
the other groups. Cancellation is checked at every step boundary and before decoding.

Batch invariance: a request's output does not depend on who shares its steps (the pipeline's denoisers
give each row its own timestep, sigmas, CFG and scheduler state). Only float rounding can differ: the
GEMM's summation order may depend on the number of rows, which on CPU fp32 flips at most one uint8
level on isolated pixels (tests/unit/test_step_scheduler.py measures it; most requests are identical).

Thread safety: `submit`/`enqueue`/`cancel`/`cancel_all` may be called from any thread (the engine's
receiver thread); `step` runs on one thread (the engine loop). Model work happens outside the lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

from diffserve.platforms import current_platform
from diffserve.platforms.step_timer import StepTimer
from diffserve.request import Req
from diffserve.runtime.memory import MemoryModel, RequestCost, request_cost

logger = logging.getLogger("diffserve.runtime")

RequestState = Literal["waiting", "running", "finished", "cancelled", "failed"]


@dataclass
class SchedulerConfig:
    #: Requests in their denoising phase at once (1: one request at a time, the pre-batching engine).
    max_running_requests: int = 8
    #: Upper bound on the running set's latent tokens x CFG branches x outputs; None: no limit.
    max_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")


@dataclass(eq=False)
class ScheduledRequest:
    """A request in the scheduler, with what admission needs to know about it."""

    req: Req
    cost: RequestCost
    #: Higher runs first; equal priorities run in arrival order.
    priority: int = 0
    seq: int = 0
    #: The caller's own object (the engine keeps its GenerateJob here).
    payload: Any = None
    state: RequestState = "waiting"
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    #: Requests in the DiT batch of each of this request's steps (1: it ran alone).
    batch_sizes: list[int] = field(default_factory=list)
    #: The platform's peak memory when the request finished (its window began when the running set
    #: was last empty, so it covers everything that ran alongside).
    peak_memory_bytes: int | None = None

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


class SchedulerEvents:
    """What the scheduler tells its owner; every hook is called on the scheduler's thread. The default
    hooks do nothing (tests read the requests' states instead)."""

    def on_started(self, sr: ScheduledRequest) -> None:
        """Admitted: its pre-denoise phase starts now."""

    def on_finished(self, sr: ScheduledRequest) -> None:
        """Decoded: `sr.req.images` / `sr.req.frames` are set; its slot is freed when this returns."""

    def on_cancelled(self, sr: ScheduledRequest) -> None:
        """Dropped at a step boundary after its `cancel_event` was set (`sr.req.step_index` steps done)."""

    def on_failed(self, sr: ScheduledRequest, error: BaseException) -> None:
        """Its own phase, or a denoising step it shared, raised `error`."""


class StepScheduler:
    def __init__(
        self,
        pipeline: Any,
        config: SchedulerConfig | None = None,
        events: SchedulerEvents | None = None,
        memory: MemoryModel | None = None,
        platform: Any = None,
        cost_fn: Callable[[Any, Any], RequestCost] = request_cost,
    ) -> None:
        """`pipeline`: anything with `run_pre_denoise`, `denoise_step`, `run_post_denoise` and `batch_key`.
        `memory`: None admits without a memory check. `cost_fn(pipeline, params)`: a request's cost."""
        self.pipeline = pipeline
        self.config = config or SchedulerConfig()
        self.events = events or SchedulerEvents()
        self.memory = memory
        self.platform = platform or current_platform()
        self.cost_fn = cost_fn
        #: Step times of every group's steps, in the order they ran (one device queue).
        self.step_timer = StepTimer(self.platform)
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._waiting: list[ScheduledRequest] = []  # kept sorted by `order`
        self._running: list[ScheduledRequest] = []  # in admission order
        self._rotation: deque[Hashable] = deque()  # batch keys, least recently served first
        #: Statistics (for tests, logs and /server_info): steps run per batch key, DiT batches by size.
        self.steps_per_group: Counter[Hashable] = Counter()
        self.batch_size_counts: Counter[int] = Counter()
        self.max_running_seen = 0

    # -- any thread ------------------------------------------------------------------------------
    def prepare(self, req: Req, priority: int = 0, payload: Any = None) -> ScheduledRequest:
        """Cost the request and check it can ever run (raises RequestTooLargeError, or the family's
        InvalidRequestError); it is not queued yet (`enqueue`), so the caller can answer first."""
        if req.cancel_event is None:
            req.cancel_event = threading.Event()
        cost = self.cost_fn(self.pipeline, req.params)
        if self.memory is not None:
            self.memory.check_alone(cost)
        return ScheduledRequest(req=req, cost=cost, priority=int(priority), payload=payload)

    def enqueue(self, sr: ScheduledRequest) -> ScheduledRequest:
        with self._cond:
            sr.seq = next(self._seq)
            sr.state = "waiting"
            self._waiting.append(sr)
            self._waiting.sort(key=lambda s: s.order)
            self._cond.notify_all()
        return sr

    def submit(self, req: Req, priority: int = 0, payload: Any = None) -> ScheduledRequest:
        return self.enqueue(self.prepare(req, priority, payload))

    def cancel(self, request_id: str) -> Literal["waiting", "running"] | None:
        """Drop a waiting request (the caller answers for it), or flag a running one: it leaves at the
        next step boundary (`on_cancelled`). None: not here (finished, or never submitted)."""
        with self._cond:
            for sr in self._waiting:
                if sr.request_id == request_id:
                    self._waiting.remove(sr)
                    sr.state = "cancelled"
                    sr.cancel_event.set()
                    return "waiting"
            for sr in self._running:
                if sr.request_id == request_id:
                    sr.cancel_event.set()
                    return "running"
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

    def running_tokens(self) -> int:
        with self._cond:
            return sum(sr.cost.batch_tokens for sr in self._running)

    def wait_for_work(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.has_work, timeout)

    # -- the scheduler's thread ------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration (see the module docstring). False: there was nothing to do."""
        did = self._drop_cancelled()
        did = self._admit() or did
        group = self._next_group()
        if group:
            self._denoise(group)
            did = True
        return did

    def run_until_idle(self, max_iterations: int = 100_000) -> None:
        """Step until nothing waits or runs (tests and scripts)."""
        for _ in range(max_iterations):
            if not self.has_work:
                return
            self.step()
        raise RuntimeError(f"the scheduler still has work after {max_iterations} iterations")

    def _drop_cancelled(self) -> bool:
        with self._cond:
            dropped = [sr for sr in self._running if sr.req.cancelled]
            for sr in dropped:
                self._running.remove(sr)
        if dropped:
            self.step_timer.flush()  # the steps they took keep their times
        for sr in dropped:
            sr.state = "cancelled"
            logger.info("Request %s cancelled at step %d", sr.request_id, sr.req.step_index)
            self._notify(self.events.on_cancelled, sr)
        return bool(dropped)

    def _fits(self, sr: ScheduledRequest) -> bool:
        running = self._running
        if not running:
            return True
        if len(running) >= self.config.max_running_requests:
            return False
        limit = self.config.max_batch_tokens
        if limit is not None and sum(r.cost.batch_tokens for r in running) + sr.cost.batch_tokens > limit:
            return False
        return self.memory is None or self.memory.fits([r.cost for r in running], sr.cost)

    def _admit(self) -> bool:
        admitted = False
        while True:
            with self._cond:
                if not self._waiting or not self._fits(self._waiting[0]):
                    return admitted
                sr = self._waiting.pop(0)
                if not self._running:
                    self.platform.reset_peak_memory()  # a new peak window for a new busy period
                sr.state = "running"
                self._running.append(sr)
                self.max_running_seen = max(self.max_running_seen, len(self._running))
            admitted = True
            sr.started_at = time.perf_counter()
            self._notify(self.events.on_started, sr)
            try:
                sr.req = self.pipeline.run_pre_denoise(sr.req)
            except Exception as exc:
                self._fail(sr, exc)
                continue
            if sr.req.is_denoised:  # no steps to share (never with num_inference_steps >= 1)
                self._complete(sr)

    def _next_group(self) -> list[ScheduledRequest]:
        """The running requests of the batch key whose turn it is (round-robin over keys)."""
        groups: dict[Hashable, list[ScheduledRequest]] = {}
        with self._cond:
            running = list(self._running)
        for sr in running:
            try:
                key = self.pipeline.batch_key(sr.req)
            except Exception as exc:
                self._fail(sr, exc)
                continue
            groups.setdefault(key, []).append(sr)
        if not groups:
            return []
        for key in [k for k in self._rotation if k not in groups]:
            self._rotation.remove(key)
        for key in groups:
            if key not in self._rotation:
                self._rotation.append(key)
        key = self._rotation[0]
        self._rotation.rotate(-1)
        self.steps_per_group[key] += 1
        return groups[key]

    def _denoise(self, group: list[ScheduledRequest]) -> None:
        reqs = [sr.req for sr in group]
        start = self.step_timer.start()
        try:
            self.pipeline.denoise_step(reqs)
        except Exception as exc:
            logger.exception(
                "A denoising step over %d request(s) failed: %s",
                len(group),
                ", ".join(sr.request_id for sr in group),
            )
            for sr in group:
                self._fail(sr, exc)
            return
        self.step_timer.stop(start, *(sr.req.step_times for sr in group))
        self.batch_size_counts[len(group)] += 1
        for sr in group:
            sr.batch_sizes.append(len(group))
            if sr.req.on_step is not None:
                try:
                    sr.req.on_step(sr.req)
                except Exception:  # a progress report must not fail the request
                    logger.exception("on_step of request %s failed", sr.request_id)
        for sr in group:
            if sr.req.is_denoised:
                self._complete(sr)

    def _complete(self, sr: ScheduledRequest) -> None:
        """Post-denoise (decoding), then free the slot and report."""
        req = sr.req
        if req.cancelled:
            self._drop_cancelled()
            return
        try:
            self.step_timer.flush()  # this request's last step times (waits for its last step, once)
            if req.step_times:
                req.timings["DenoisingStage"] = sum(req.step_times)
            sr.req = self.pipeline.run_post_denoise(req)
        except Exception as exc:
            self._fail(sr, exc)
            return
        sr.peak_memory_bytes = self.platform.memory_info().peak_bytes
        sr.state = "finished"
        try:  # still in the running set while reported, so a cancel now still reaches it (a video's file)
            self.events.on_finished(sr)
        except Exception as exc:
            logger.exception("Request %s: reporting its result failed", sr.request_id)
            sr.state = "failed"
            self._notify(self.events.on_failed, sr, exc)
        finally:
            self._remove(sr)

    def _fail(self, sr: ScheduledRequest, error: BaseException) -> None:
        self._remove(sr)
        sr.state = "failed"
        self._notify(self.events.on_failed, sr, error)

    def _remove(self, sr: ScheduledRequest) -> None:
        with self._cond:
            if sr in self._running:
                self._running.remove(sr)

    @staticmethod
    def _notify(hook: Callable[..., None], *args: Any) -> None:
        try:
            hook(*args)
        except Exception:
            logger.exception("Scheduler event %s failed", getattr(hook, "__name__", hook))
