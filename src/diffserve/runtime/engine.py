"""`Engine`: the one request loop (CLI, `DiffGenerator`, server, warm-up and calibration submit here).
A `step`: cancelled requests leave, admitted ones run pre-denoise, one batch-key group runs one denoising
step as one DiT batch, and every decode in progress runs one chunk (`DecodeTask`: a long video's decode
never holds the other requests' steps, and a cancel stops it between two chunks); an error fails only its
request (or group). A request may run only some of its phases here (its `PhaseSpan`, phases.py: the
engines of disaggregated serving): one that arrived as a hand-off skips validation and encoding, one that
leaves as a hand-off is reported once its last phase here is done. Any thread
submits; one at a time drives the loop (`run_to_completion`, for every caller: concurrent `generate`
calls share DiT batches), with the engine's attention backend active. Its memory model (admission and
automatic VAE tiling) is built here too, whoever drives the engine (`Engine.build_memory_model`)."""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, LoraError, RequestCancelledError
from diffserve.layers.attention import AttentionBackend
from diffserve.logging_setup import shown_text
from diffserve.phases import WHOLE, PhaseSpan
from diffserve.platforms.base import Platform
from diffserve.request import Req
from diffserve.runtime.contract import EnginePipeline
from diffserve.runtime.decode_task import DecodeTask
from diffserve.runtime.memory import NO_OFFLOAD, MemoryModel, RequestCost, WeightResidency, request_cost
from diffserve.runtime.runner import ModelRunner
from diffserve.runtime.scheduler import ScheduledRequest, SchedulerConfig, StepScheduler
from diffserve.vae_tiling import decode_chunk_scope, decode_output_scope, tiled_decode_scope

if TYPE_CHECKING:
    from diffserve.configs.engine_args import EngineArgs

logger = logging.getLogger("diffserve.runtime")

_WAIT_SLICE_SECONDS = 0.02
T = TypeVar("T")


def check_step_limit(most: int | None, steps: int | None) -> None:
    """The engine's bound on denoising steps (InvalidRequestError naming the field); None: no bound."""
    if most is not None and steps is not None and steps > most:
        raise InvalidRequestError(
            f"num_inference_steps must be <= {most} (this engine's --max-inference-steps), got {steps}",
            param="num_inference_steps",
        )


class EngineEvents:
    """What the engine tells its owner, on the driving thread; the defaults do nothing."""

    def on_started(self, sr: ScheduledRequest) -> None:
        """Admitted: its pre-denoise phase starts now."""

    def on_finished(self, sr: ScheduledRequest) -> None:
        """Its last phase here is done: decoded (`sr.req.outputs` holds its images or frames), or, for a
        span ending before decode (`sr.span`), ready to be handed off; its slot is freed when this returns."""

    def on_cancelled(self, sr: ScheduledRequest) -> None:
        """Dropped after its `cancel_event` was set (`sr.req.step_index` steps done)."""

    def on_failed(self, sr: ScheduledRequest, error: BaseException) -> None:
        """Its own phase, or a denoising step it shared, raised `error`."""


class Engine:
    def __init__(
        self,
        pipeline: EnginePipeline,
        platform: Platform,
        config: SchedulerConfig | None = None,
        events: EngineEvents | None = None,
        memory: MemoryModel | None = None,
        *,
        attention_backend: AttentionBackend,
        runner: ModelRunner | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.platform = platform
        #: One rank's runner, or rank 0's `DistributedRunner` that drives every rank through the same step.
        self.runner = runner or ModelRunner(pipeline, platform, attention_backend)
        self.scheduler = StepScheduler(config, memory)
        self.events = events or EngineEvents()
        #: Per-request start, progress and finish lines (the server's); None: only the stage lines.
        self.request_log: RequestLog | None = None
        self._driving = threading.RLock()
        #: Calls waiting to run on the driving thread between two steps (`run_exclusive`).
        self._between_steps: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        #: Decode a chunk per loop iteration, between other requests' steps (`_interleaves_decodes`); False:
        #: each decode runs whole once its last step is done (a cancel still stops it between two chunks).
        self.interleave_decodes = True
        #: Decodes in progress (its task, whether it is tiled automatically), in start order ...
        self._decodes: dict[ScheduledRequest, tuple[DecodeTask[Req], bool]] = {}
        #: ... and requests whose steps are done, waiting for theirs to start (`_start_decodes`).
        self._decode_queue: deque[ScheduledRequest] = deque()

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.runner.attention_backend

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def memory(self) -> MemoryModel | None:
        return self.scheduler.memory

    @memory.setter
    def memory(self, model: MemoryModel | None) -> None:
        self.scheduler.memory = model

    def build_memory_model(
        self,
        args: EngineArgs,
        weights: WeightResidency = NO_OFFLOAD,
        vae: object | None = None,
        calibrate: bool = False,
    ) -> MemoryModel:
        """Build this engine's memory model (`calibration.build_memory_model`: the same for the server, the
        CLI and `DiffGenerator`) and admit by it from now on: a request that can never fit is refused at
        `prepare` (RequestTooLargeError, the server's 413), one that does not fit now waits, and a decode
        that would not fit untiled is tiled (`_decode_tiled`). `calibrate` runs probe requests through this
        engine, so call it while no other request runs."""
        from diffserve.runtime.calibration import build_memory_model  # it imports this module

        model = build_memory_model(self, args, weights, vae, calibrate)
        self.memory = model
        budget = "unknown" if model.budget_bytes is None else f"{model.budget_bytes / 2**20:.0f} MB"
        logger.info(
            "Memory model (%s): budget %s for requests (free memory x --mem-fraction %g), VAE tiling %s",
            model.source, budget, args.mem_fraction, model.vae_tiling_mode,
        )  # fmt: skip
        return model

    def prepare(
        self, req: Req, priority: int = 0, payload: object | None = None, span: PhaseSpan = WHOLE
    ) -> ScheduledRequest:
        """Validate (once) and cost the request, not queued yet (`enqueue`); raises InvalidRequestError, or
        RequestTooLargeError when it can never fit in memory. `span`: the phases this engine runs for it;
        one starting after encode takes a request that arrived as a hand-off (runtime/handoff.py), which
        its encoding engine validated. Its LoRA adapters are checked and held only where it denoises."""
        if req.cancel_event is None:
            req.cancel_event = threading.Event()
        if span.runs("encode"):
            req = self.runner.validate(req)
        check_step_limit(self.config.max_inference_steps, req.params.num_inference_steps)
        if span.runs("denoise"):
            try:
                self.runner.check_loras(req.params.loras)
            except LoraError as exc:
                raise InvalidRequestError(str(exc), param="loras") from None
        cost = self.cost(req)
        if self.scheduler.memory is not None:
            self.scheduler.memory.check_alone(cost)
        sr = ScheduledRequest(req=req, cost=cost, priority=int(priority), payload=payload, span=span)
        self._hold_loras(sr)  # last: a request refused above holds nothing (else see `discard`)
        return sr

    def cost(self, req: Req) -> RequestCost:
        return request_cost(self.pipeline.facts, req)

    def enqueue(self, sr: ScheduledRequest, seq: int | None = None) -> ScheduledRequest:
        """Queue a `prepare`d request; `seq`: its arrival number (`StepScheduler.reserve_seq`), else now."""
        return self.scheduler.add(sr, seq)

    def submit(
        self, req: Req, priority: int = 0, payload: object | None = None, span: PhaseSpan = WHOLE
    ) -> ScheduledRequest:
        return self.enqueue(self.prepare(req, priority, payload, span))

    def cancel(self, request_id: str) -> str | None:
        """ "waiting" (dropped and reported now), "running" (leaves at its next step boundary) or None."""
        found = self.scheduler.cancel(request_id)
        if found is None:
            return None
        where, sr = found
        if where == "waiting":
            self._end(sr, self.events.on_cancelled)
        return where

    def cancel_all(self) -> list[ScheduledRequest]:
        """Drop every waiting request (reported cancelled, and returned) and flag every running one."""
        dropped = self.scheduler.cancel_all()
        for sr in dropped:
            self._end(sr, self.events.on_cancelled)
        return dropped

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def run_exclusive(self, call: Callable[[], T]) -> T:
        """Run `call` between two steps, never during one (loading or unloading a LoRA adapter: with several
        ranks, its broadcast must not interleave with a step's); a decode may be paused between two chunks.
        Runs now when no thread drives the loop; else the driving thread runs it before its next step, and
        this waits for its result."""
        if self._driving.acquire(blocking=False):
            try:
                with self.runner.model_scope():
                    return call()
            finally:
                self._driving.release()
        future: Future[T] = Future()
        self._between_steps.put((call, future))
        while True:
            try:
                return future.result(timeout=_WAIT_SLICE_SECONDS)
            except TimeoutError:  # the driver may have gone idle before its next step: run it here
                if self._driving.acquire(blocking=False):
                    try:
                        with self.runner.model_scope():
                            self._run_between_steps()
                    finally:
                        self._driving.release()

    def _run_between_steps(self) -> None:
        while True:
            try:
                call, future = self._between_steps.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the caller, never raised in the loop
                future.set_exception(exc)

    def step(self) -> bool:
        """One iteration (see the module docstring). False: there was nothing to do."""
        with self._driving, self.runner.model_scope():
            self._run_between_steps()
            did = self._drop_cancelled()
            if len(self._decodes) < 2:  # admission costs one decode at a time (`_may_decode_beside`)
                did = self._start_admitted() or did
            group, broken = self.scheduler.next_group(self.pipeline.batch_key)
            for sr, exc in broken:
                self._fail(sr, exc)
            if group:
                self._denoise(group)
                did = True
            did = self._advance_decodes() or did
            return did or bool(broken)

    def run_until_idle(self, max_iterations: int = 100_000) -> None:
        """Step until nothing waits or runs."""
        with self._driving:
            for _ in range(max_iterations):
                if not self.scheduler.has_work:
                    return
                self.step()
        raise RuntimeError(f"the engine still has work after {max_iterations} iterations")

    def run_once(self, timeout: float = 0.0) -> bool:
        """One iteration, after waiting up to `timeout` seconds for work. False: idle."""
        if not self.scheduler.has_work and not self.scheduler.wait_for_work(timeout):
            return False
        return self.step()

    def run_to_completion(self, requests: Sequence[ScheduledRequest]) -> None:
        """Return once every one of `requests` (enqueued) has ended, driving the loop while no other thread does."""
        while True:
            pending = [sr for sr in requests if not sr.done.is_set()]
            if not pending:
                return
            if self._driving.acquire(blocking=False):
                try:
                    while any(not sr.done.is_set() for sr in requests):
                        if not self.step():
                            self.scheduler.wait_for_work(_WAIT_SLICE_SECONDS)
                finally:
                    self._driving.release()
            else:
                pending[0].done.wait(_WAIT_SLICE_SECONDS)

    def _drop_cancelled(self) -> bool:
        dropped = self.scheduler.take_cancelled()
        if dropped:
            self.runner.flush_step_times()  # the steps they took keep their times
        for sr in dropped:
            decoding = self._stop_decode(sr)
            if self.request_log is None:  # else its finish line says so, in these words
                where = "while decoding" if decoding else f"at step {sr.req.step_index}"
                logger.info("Request %s cancelled %s", sr.request_id, where)
            self._end(sr, self.events.on_cancelled)
        return bool(dropped)

    def _stop_decode(self, sr: ScheduledRequest) -> bool:
        """Stop `sr`'s decode where it is paused (between two chunks), or drop it from the decode queue;
        True when it had one."""
        if sr in self._decode_queue:
            self._decode_queue.remove(sr)
            return True
        decode = self._decodes.pop(sr, None)
        if decode is None:
            return False
        decode[0].cancel()
        return True

    def _start_admitted(self) -> bool:
        opens_busy_period = self.scheduler.num_running == 0
        admitted = self.scheduler.admit(self._loras_ready)
        if not admitted:
            self._wait_for_loras()
        if admitted and opens_busy_period:
            self.runner.reset_peak_memory()  # a new peak window for a new busy period
        for sr in admitted:
            self._notify(self.events.on_started, sr)
            if self.request_log is not None:
                self.request_log.started(sr, self.scheduler.num_running, self.scheduler.num_waiting)
            try:
                sr.req = self.runner.pre_denoise(sr.req, sr.span)
            except Exception as exc:
                self._fail(sr, exc)
                continue
            if sr.span.last == "encode":  # encoded: handed off to the engine that denoises it
                self._hand_off(sr)
                continue
            if self.request_log is not None:
                self.request_log.denoising(sr)
            if sr.req.is_denoised:  # no steps to share (never with num_inference_steps >= 1; a decode span)
                self._complete(sr)
            else:
                logger.info(
                    "[DenoisingStage] started... (%d step(s), request %s)",
                    sr.req.num_steps,
                    sr.request_id[:8],
                )
        return bool(admitted)

    def _denoise(self, group: list[ScheduledRequest]) -> None:
        try:
            self.runner.denoise_step([sr.req for sr in group], self.scheduler.step_samples(group))
        except Exception as exc:
            logger.exception(
                "A denoising step over %d request(s) failed: %s",
                len(group),
                ", ".join(sr.request_id for sr in group),
            )
            for sr in group:
                self._fail(sr, exc)
            return
        self.scheduler.record_step(group)
        for sr in group:
            if sr.req.on_step is not None:
                try:
                    sr.req.on_step(sr.req)
                except Exception:  # a progress report must not fail the request
                    logger.exception("on_step of request %s failed", sr.request_id)
        if self.request_log is not None:
            self.request_log.stepped()
        for sr in group:
            if sr.req.is_denoised:
                self._complete(sr)

    def _decode_tiled(self, sr: ScheduledRequest) -> bool:
        """Automatic VAE tiling (`MemoryModel.decode_tiled`): tile this decode when the untiled one would
        not fit beside the other running requests. With --vae-tiling the VAE tiles already."""
        memory = self.scheduler.memory
        if memory is None or memory.vae_tiling_mode != "auto":
            return False
        others = [cost for cost in self.scheduler.running_costs() if cost is not sr.cost]
        tiled = memory.decode_tiled(others, sr.cost)
        if tiled:
            logger.info(
                "Request %s: VAE decode tiled (untiled, it would not fit in memory)", sr.req.request_id
            )
        return tiled

    def _output_hook(self, req: Req) -> Callable[[Any], None] | None:
        """A streamed video job's `on_decoded`, handed the decoded chunks (vae_tiling.decode_output_scope)
        on one rank only: split over ranks, a rank's VAE decodes a band of rows, not the frames."""
        return req.on_decoded if self._one_rank() else None

    def _one_rank(self) -> bool:
        state = self.runner.parallel_state
        return state is None or state.world_size == 1

    def _interleaves_decodes(self) -> bool:
        """Whether decodes run a chunk per loop iteration between other requests' steps: on one rank,
        unless weights move in for a stage (component offload: each chunk would swap the DiT and the VAE).
        With several ranks every rank runs the decode in lockstep (its row split exchanges rows), so rank 0
        decides nothing else meanwhile and cannot stop it halfway."""
        memory = self.scheduler.memory
        offloaded = memory is not None and memory.weights.swap_bytes > 0
        return self.interleave_decodes and self._one_rank() and not offloaded

    def _complete(self, sr: ScheduledRequest) -> None:
        """Its last step is done: post-denoise (decoding: queued for `_advance_decodes`, or run whole now
        when decodes are not interleaved), then report and free the slot."""
        req = sr.req
        if req.cancelled:
            self._drop_cancelled()
            return
        if sr.span.runs("denoise"):
            self.runner.flush_step_times()  # its last steps' times (waits for its last step, once)
            log_denoising(req)
        if sr.span.last == "denoise":  # denoised: handed off to the engine that decodes it
            self._hand_off(sr)
            return
        if self._interleaves_decodes():
            self._decode_queue.append(sr)
            self._start_decodes()
            return
        if self.request_log is not None:
            self.request_log.decoding(sr)
        check = _cancel_check(req) if self._one_rank() else None
        try:
            with (
                tiled_decode_scope(self._decode_tiled(sr)),
                decode_chunk_scope(check),
                decode_output_scope(self._output_hook(req)),
            ):
                sr.req = self.runner.post_denoise(req)
        except Exception as exc:
            self._fail(sr, exc)
            return
        self._report(sr)

    def _start_decodes(self) -> None:
        """Start the queued decodes, in order, while `_may_decode_beside` lets each start."""
        while self._decode_queue:
            sr = self._decode_queue[0]
            if self._decodes and not self._may_decode_beside(sr):
                return
            self._decode_queue.popleft()
            if self.request_log is not None:
                self.request_log.decoding(sr)
            tiled = self._decode_tiled(sr)
            # The task's thread runs in a copy of this context.
            with tiled_decode_scope(tiled), decode_output_scope(self._output_hook(sr.req)):
                call = functools.partial(self.runner.post_denoise, sr.req)
                task = DecodeTask(call, f"decode-{sr.request_id[:8]}", self.platform.bind_device)
            self._decodes[sr] = (task, tiled)

    def _may_decode_beside(self, sr: ScheduledRequest) -> bool:
        """Whether `sr`'s decode may start while others are in progress: when the running set fits the
        budget with all of those decodes at once (admission's `MemoryModel.total` counts one decode, so
        none is admitted while two run: `step`), and none of them is tiled automatically (that sets the
        VAE's own tiling switch while it runs). Else it waits its turn."""
        memory = self.scheduler.memory
        if memory is None:
            return True
        if any(tiled for _, tiled in self._decodes.values()):
            return False
        running = self.scheduler.running_costs()
        others = [cost for cost in running if cost is not sr.cost]
        if memory.vae_tiling_mode == "auto" and memory.decode_tiled(others, sr.cost):
            return False
        if memory.budget_bytes is None:
            return True
        decoding = [*(s.cost for s in self._decodes), sr.cost]
        need = sum(memory.denoise_bytes(c) for c in running) + sum(memory.decode_bytes(c) for c in decoding)
        return need + memory.weights.swap_bytes <= memory.budget_bytes

    def _advance_decodes(self) -> bool:
        """One chunk of every decode in progress; the ones that end are reported. False: none ran."""
        self._start_decodes()
        if not self._decodes:
            return False
        for sr, (task, _) in list(self._decodes.items()):
            if task.advance():
                del self._decodes[sr]
                self._decoded(sr, task)
        self._start_decodes()
        return True

    def _decoded(self, sr: ScheduledRequest, task: DecodeTask[Req]) -> None:
        error = task.error
        if error is not None:
            if not isinstance(error, Exception):
                raise error
            self._fail(sr, error)
            return
        assert task.result is not None
        sr.req = task.result
        self._report(sr)

    def _hand_off(self, sr: ScheduledRequest) -> None:
        """Its span ends before decode (`sr.span`): it leaves the denoising loop, then is reported as
        finished here (its owner packs the hand-off, runtime/handoff.py, in `on_finished`)."""
        self.runner.release(sr.req)
        self._report(sr)

    def _report(self, sr: ScheduledRequest) -> None:
        """Decoded (or ready to hand off): report it, then free its slot."""
        if self.request_log is not None:
            self.request_log.decoded(sr)
        sr.peak_memory_bytes = self.runner.peak_memory_bytes()
        sr.state = "finished"
        try:  # still in the running set while reported, so a cancel now still reaches it (a video's file)
            self.events.on_finished(sr)
        except Exception as exc:
            logger.exception("Request %s: reporting its result failed", sr.request_id)
            sr.state = "failed"
            sr.error = exc
            self._notify(self.events.on_failed, sr, exc)
        finally:
            self.scheduler.remove(sr)
            self._unhold_loras(sr)
            self._log_end(sr)
            sr.done.set()

    def _fail(self, sr: ScheduledRequest, error: BaseException) -> None:
        self.scheduler.remove(sr)
        self.runner.release(sr.req)
        if isinstance(error, RequestCancelledError):
            sr.state = "cancelled"
            if self.request_log is None:  # else its finish line says so
                logger.info("Request %s cancelled: %s", sr.request_id, error)
            self._end(sr, self.events.on_cancelled)
            return
        sr.state = "failed"
        sr.error = error
        self._unhold_loras(sr)
        self._notify(self.events.on_failed, sr, error)
        self._log_end(sr)
        sr.done.set()

    def _end(self, sr: ScheduledRequest, hook: Callable[[ScheduledRequest], None]) -> None:
        self.runner.release(sr.req)
        self._unhold_loras(sr)
        self._notify(hook, sr)
        self._log_end(sr)
        sr.done.set()

    # -- the LoRA adapters requests name (runtime/lora_registry.py) ------------------------------------

    def _hold_loras(self, sr: ScheduledRequest) -> None:
        """An admitted request holds the adapters it names until it ends (unloading one is refused
        meanwhile); the ones not resident are read in the background, and it starts once they are."""
        registry = self.runner.loras
        if registry is not None and sr.req.params.loras and sr.span.runs("denoise"):
            try:
                registry.hold(id(sr), [choice.name for choice in sr.req.params.loras])
            except LoraError as exc:
                raise InvalidRequestError(str(exc), param="loras") from None

    def _unhold_loras(self, sr: ScheduledRequest) -> None:
        if self.runner.loras is not None:
            self.runner.loras.unhold(id(sr))

    def discard(self, sr: ScheduledRequest) -> None:
        """A request `prepare`d that will not be enqueued: let go of what it holds."""
        self._unhold_loras(sr)

    def _loras_ready(self, sr: ScheduledRequest) -> bool:
        return self.runner.loras is None or self.runner.loras.ready(id(sr))

    def _wait_for_loras(self) -> None:
        """Nothing was admitted though nothing runs: the waiting requests' adapters are still being read
        (or do not fit beside pinned ones yet). Wait a moment for a read to finish, not spinning the loop."""
        registry = self.runner.loras
        if registry is None or self.scheduler.num_running or not self.scheduler.num_waiting:
            return
        if not registry.wait_for_reads(_WAIT_SLICE_SECONDS):
            time.sleep(_WAIT_SLICE_SECONDS)

    def _log_end(self, sr: ScheduledRequest) -> None:
        if self.request_log is not None:
            self.request_log.ended(sr)

    @staticmethod
    def _notify(hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            logger.exception("Engine event %s failed", hook.__name__)


def _cancel_check(req: Req) -> Callable[[], None]:
    """A decode's chunk hook (`decode_chunk_scope`) that stops it once `req` is cancelled."""

    def check() -> None:
        if req.cancelled:
            raise RequestCancelledError(f"request {req.request_id} cancelled during its decode")

    return check


def log_denoising(req: Req) -> None:
    """The denoising phase's time (`timings.stages`) and summary log lines."""
    if req.timings.steps:
        req.timings.stages["DenoisingStage"] = sum(req.timings.steps)
        logger.info(
            "[DenoisingStage] average time per step: %.4f seconds",
            sum(req.timings.steps) / len(req.timings.steps),
        )
    cache = req.step_cache
    if cache is not None:
        chosen = f"quality={req.params.quality}" if req.params.quality != "high" else f"cache={cache.method}"
        logger.info(
            "[%s] %s: %d of %d steps computed in full, %d reused the cached residual; DiT blocks computed %d, "
            "reused %d",
            req.request_id[:8], chosen, cache.steps_computed, req.num_steps, cache.steps_reused,
            cache.blocks_computed, cache.blocks_reused,
        )  # fmt: skip


#: `RequestLog`'s word for how a request ended, by `ScheduledRequest.state`.
_END_STATUS = {"finished": "completed", "cancelled": "cancelled", "failed": "failed"}


@dataclass
class _Tracked:
    """What `RequestLog` keeps of one admitted request until its finish line (perf_counter seconds)."""

    sr: ScheduledRequest
    denoise_started: float | None = None  # pre-denoise done
    decode_started: float | None = None  # last step done
    decode_ended: float | None = None  # outputs decoded (then reported: encoded, written)
    reported_at: float | None = None  # its last progress entry
    reported_step: int = 0


class RequestLog:
    """Per-request INFO lines of a serving engine (`Engine.request_log`; the CLI has its own parameter lines
    and s/step bar): a start line with the resolved parameters (prompt shortened, `shown_text`) when a
    request is admitted; at most one progress line per `interval` seconds, shared by every request that
    has been denoising for at least that long (step/total, s/step since its last entry, time left), so a
    short request prints none and a batch of eight prints one line, not eight; and a finish line with its
    status and timings. `include` picks the requests logged (the server leaves its health probes out).
    Its state is one entry per admitted request, dropped with the finish line."""

    def __init__(
        self,
        interval: float = 5.0,
        include: Callable[[ScheduledRequest], bool] = lambda sr: True,
        clock: Callable[[], float] = time.perf_counter,  # the clock of `ScheduledRequest`'s timestamps
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the progress log interval must be > 0 seconds, got {interval!r}")
        self.interval, self.include, self.clock = interval, include, clock
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()  # a waiting request is cancelled (and ended) on another thread
        self._last_line = -math.inf

    def started(self, sr: ScheduledRequest, running: int, waiting: int) -> None:
        """Admitted: its start line; tracked until `ended`."""
        if not self.include(sr):
            return
        with self._lock:
            self._tracked[sr.request_id] = _Tracked(sr)
        queued = (sr.started_at or self.clock()) - sr.submitted_at
        logger.info(
            "Request %s started (queued %.2f s; %d running, %d waiting): %s",
            sr.request_id, queued, running, waiting, describe_params(sr.req.params),
        )  # fmt: skip

    def denoising(self, sr: ScheduledRequest) -> None:
        """Pre-denoise (text encoding, latents, timesteps) done: its steps start."""
        if (tracked := self._tracked.get(sr.request_id)) is not None:
            tracked.denoise_started = tracked.reported_at = self.clock()

    def stepped(self) -> None:
        """After a denoising step: one progress line if `interval` has passed since the last one, over the
        requests denoising for at least `interval`."""
        now = self.clock()
        if now - self._last_line < self.interval:
            return
        with self._lock:
            due = [t for t in self._tracked.values() if self._due(t, now)]
        if not due:
            return
        self._last_line = now
        logger.info("Progress: %s", "; ".join(self._progress(t, now) for t in due))

    def _due(self, tracked: _Tracked, now: float) -> bool:
        started = tracked.denoise_started
        return started is not None and tracked.decode_started is None and now - started >= self.interval

    @staticmethod
    def _progress(tracked: _Tracked, now: float) -> str:
        """`{id} step k/n, s/step since its last entry, time left at that pace`; updates the last entry."""
        req = tracked.sr.req
        done, total = req.step_index, req.num_steps
        steps = done - tracked.reported_step
        if steps <= 0:  # other batch groups had the steps since
            return f"{req.request_id} step {done}/{total}, waiting for its turn"
        pace = (now - (tracked.reported_at or now)) / steps
        tracked.reported_at, tracked.reported_step = now, done
        return f"{req.request_id} step {done}/{total}, {pace:.3f} s/step, ~{pace * (total - done):.0f} s left"

    def decoding(self, sr: ScheduledRequest) -> None:
        """Its last step is done (and timed): decoding starts."""
        if (tracked := self._tracked.get(sr.request_id)) is not None:
            tracked.decode_started = self.clock()

    def decoded(self, sr: ScheduledRequest) -> None:
        """Its outputs are decoded: reporting them (encoding images, handing a video over) starts."""
        if (tracked := self._tracked.get(sr.request_id)) is not None:
            tracked.decode_ended = self.clock()

    def ended(self, sr: ScheduledRequest) -> None:
        """Its finish line: status, total time, then queue, pre-denoise, denoise, decode and output (encoding
        images; a video's file is written after, and logged by its writer) times, peak memory, outputs."""
        if not self.include(sr):
            return
        with self._lock:
            tracked = self._tracked.pop(sr.request_id, None)
        now = self.clock()
        status = _END_STATUS.get(sr.state, sr.state)
        if sr.state == "failed" and sr.error is not None:
            status += f" ({type(sr.error).__name__})"
        elif sr.state == "cancelled" and sr.started_at is None:
            status += " while waiting"
        elif sr.state == "cancelled":
            decoding = (
                tracked is not None and tracked.decode_started is not None and tracked.decode_ended is None
            )
            status += " while decoding" if decoding else f" at step {sr.req.step_index}"
        parts = [f"queued {((sr.started_at or now) - sr.submitted_at):.2f} s"]
        if tracked is not None:
            parts += _phase_times(tracked, now)
        if sr.peak_memory_bytes is not None:
            parts.append(f"peak memory {sr.peak_memory_bytes / 2**20:.0f} MiB")
        if sr.state == "finished":
            parts.append(_outputs(sr.req))
        logger.info(
            "Request %s %s in %.2f s: %s", sr.request_id, status, now - sr.submitted_at, ", ".join(parts)
        )


def _phase_times(tracked: _Tracked, now: float) -> list[str]:
    """Pre-denoise, denoise (steps done of all, s/step, mean DiT batch), decode and output times, as far as
    it got."""
    sr, parts = tracked.sr, []
    started, denoised, decoded = tracked.denoise_started, tracked.decode_started, tracked.decode_ended
    parts.append(f"prepare {((started or now) - (sr.started_at or now)):.2f} s")
    if started is None:
        return parts
    seconds, done = (denoised or now) - started, sr.req.step_index
    batch = sum(sr.batch_sizes) / len(sr.batch_sizes) if sr.batch_sizes else 0.0
    per_step = f"{seconds / done:.3f} s/step, " if done else ""
    parts.append(
        f"denoise {seconds:.2f} s ({done}/{sr.req.num_steps} steps, {per_step}mean batch {batch:.1f})"
    )
    if denoised is not None:
        parts.append(f"decode {(decoded or now) - denoised:.2f} s")
    if decoded is not None:
        parts.append(f"output {now - decoded:.2f} s")
    return parts


def _outputs(req: Req) -> str:
    if req.outputs.frames:
        return f"{len(req.outputs.frames)} video(s)"
    return f"{len(req.outputs.images or [])} image(s)"


def describe_params(params: SamplingParams) -> str:
    """A request's resolved parameters in one line, the prompt and negative prompt shortened (`shown_text`)."""
    p = params
    parts = [f"{p.width}x{p.height}", f"{p.num_inference_steps} steps"]
    if p.num_frames is not None:
        parts.append(f"{p.num_frames} frames at {p.fps} fps")
    if p.guidance_scale is not None:
        parts.append(f"guidance {p.guidance_scale:g}")
    if p.true_cfg_scale is not None:
        parts.append(f"true_cfg_scale {p.true_cfg_scale:g}")
    parts += [f"seed {p.seed}", f"quality {p.quality or 'default'}", f"n={p.num_outputs_per_prompt}"]
    parts.append(f"prompt {shown_text(p.prompt)}")
    if p.negative_prompt:
        parts.append(f"negative_prompt {shown_text(p.negative_prompt, 40)}")
    return ", ".join(parts)
