"""The front end's side of the engine link: the engine process, its sockets and the requests in flight.

The receive task resolves the requests' futures; the watch task restarts a dead engine process, failing
its requests in flight (503), and kills and restarts a stuck one the same way: a step, message or
admission lasting `--engine-watchdog-seconds`, by the engine's heartbeat, or that long without one
(`EngineHeartbeat`, engine_liveness.py). No call here blocks on model work.

LoRA admin ops (`load_lora`, `unload_lora`, `list_loras`) go through `lora_client.LoraOps`; an engine
process that (re)starts replays the loads and unloads made so far before it takes requests.

Shutdown has two speeds: `begin_drain` (first SIGTERM / Ctrl-C) lets the requests in flight, video jobs
included, finish for `--shutdown-timeout` seconds before cancelling the rest; `abort` (a second signal)
kills the engine process at once and answers everything in flight with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from diffserve.process_start import process_context
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_liveness import HEARTBEAT_INTERVAL_S
from diffserve.server.engine_process import EngineProcessConfig, run_engine_process
from diffserve.server.ipc_dirs import make_ipc_dir, remove_stale_ipc_dirs
from diffserve.server.lora_client import LoraOpError, LoraOps, new_op_id
from diffserve.server.metrics import ServerMetrics

logger = logging.getLogger("diffserve.server")

WATCH_INTERVAL_S = 0.2
ENGINE_STOP_TIMEOUT_S = 10.0
#: How long `abort` waits for the killed engine process to be reaped (SIGKILL cannot be ignored).
ENGINE_KILL_WAIT_S = 5.0


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


#: What a request is told while the engine is not ready, by state: (message, code).
_UNAVAILABLE: dict[EngineState | None, tuple[str, str]] = {
    EngineState.STARTING: ("the engine is not ready yet (loading the model and warming up); retry shortly", "engine_starting"),
    EngineState.RESTARTING: ("the engine is restarting after its process died; retry shortly", "engine_restarting"),
    EngineState.STOPPING: ("the server is shutting down", "shutting_down"),
    EngineState.STOPPED: ("the server has stopped", "shutting_down"),
    None: ("the engine is not available", "engine_unavailable"),
}  # fmt: skip


class EngineUnavailableError(Exception):
    """Not ready, restarting, died mid-request or shutting down (-> 503)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EngineDiedError(EngineUnavailableError):
    """The engine process died with this request in flight (503 `engine_died`); `started`: whether it had
    started there (its work is lost). One that had not is sent to another replica when one is ready
    (`replicas.ReplicaSet`)."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message, code="engine_died")
        self.started = started


class JobCancelledError(EngineUnavailableError):
    """The engine cancelled the job: at the front end's request (client gone, DELETE) or shutting down."""

    def __init__(self, at_step: int | None) -> None:
        super().__init__("the engine cancelled this request (the server is shutting down)", code="cancelled")
        self.at_step = at_step


class QueueFullError(Exception):
    """--max-queue-size requests are already waiting (-> 429)."""


class JobRejectedError(Exception):
    """The engine refused the job before queueing: invalid (-> 400) or too large to ever fit (-> 413)."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class JobFailedError(Exception):
    """The request failed inside the engine (-> 500, or 400 naming `param` when `user_error`)."""

    def __init__(self, message: str, user_error: bool, param: str | None = None) -> None:
        super().__init__(message)
        self.user_error, self.param = user_error, param


#: Called with a submitted job's JobStarted, JobProgress and JobPreview messages, on the event loop.
JobListener = Callable[[msg.JobStarted | msg.JobProgress | msg.JobPreview | msg.JobChunk], None]
#: Called with the engine's info (EngineReady.info) each time an engine process reports ready, before
#: requests are accepted; raising makes the engine client fail (the server stops).
ReadyHook = Callable[[dict[str, Any]], None]


@dataclass
class PendingRequest:
    job: msg.GenerateJob
    future: asyncio.Future
    submitted_at: float
    started_at: float | None = None
    #: `submit` only: resolved with the engine's JobAccepted (or its rejection), and the job's listener.
    accepted: asyncio.Future | None = None
    listener: JobListener | None = None


async def _serialized(job: msg.GenerateJob) -> bytes:
    """The job as the engine's `recv_pyobj` reads it; pickled off the event loop when it carries images (or
    an input video's frames)."""
    params = job.params
    if params.input_images or params.mask_image is not None or params.controlnets or params.input_video:
        return await asyncio.to_thread(pickle.dumps, job, pickle.DEFAULT_PROTOCOL)
    return pickle.dumps(job, pickle.DEFAULT_PROTOCOL)


class EngineClient:
    """One engine process: spawned, supervised (restarted when it dies) and talked to over ZeroMQ.

    `replica` numbers it among `--dp-size` replicas (0 alone): it names the process and the log lines,
    and with several replicas picks the replica's devices. `queued_total` counts the requests waiting
    beyond free running slots that `--max-queue-size` limits: this client's alone by default, every
    replica's with several (the limit is server-wide)."""

    def __init__(
        self,
        args: ServerArgs,
        metrics: ServerMetrics,
        on_fatal: Callable[[int, str], None],
        replica: int = 0,
        queued_total: Callable[[], int] | None = None,
    ) -> None:
        self.args, self.metrics, self.on_fatal = args, metrics, on_fatal
        self.replica = replica
        self.name = "Engine" if args.dp_size == 1 else f"Replica {replica}"
        self._queued_total = queued_total or (lambda: self.num_queued)
        self.state, self.state_detail = EngineState.STOPPED, ""
        self.incarnation = self.restarts = 0
        self.completed = 0  # requests the engine finished (health probes included), shown per replica
        self.engine_pid: int | None = None
        self.engine_info: dict[str, Any] = {}
        self.probe_size = 64
        self._pending: dict[str, PendingRequest] = {}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._fatal: msg.EngineFatal | None = None
        self._engine_ready = self._ever_ready = False  # the current engine process / any has reported ready
        self._failed_starts = 0
        self._tasks: list[asyncio.Task] = []
        self._drain_task: asyncio.Task | None = None
        self._ipc_dir: Path | None = None
        #: Requests the engine runs at once, as it reported when ready (0 before): see `num_queued`.
        self.engine_slots = 0
        self.ready_hooks: list[ReadyHook] = []
        #: LoRA admin ops in flight, and the loads and unloads replayed on an engine that (re)starts.
        self.loras = LoraOps(self.name, self._send_lora_op)
        #: The ready engine's last heartbeat (None: none since it became ready) and when it was heard.
        self._heartbeat: msg.EngineHeartbeat | None = None
        self._heard_at = 0.0
        #: Why the engine was killed as stuck (`_wedged`), until its replacement is ready.
        self._wedge: str | None = None

    async def start(self) -> None:
        # A private 0700 directory: only this user reaches the sockets.
        remove_stale_ipc_dirs()
        self._ipc_dir = make_ipc_dir(self.replica)
        logger.info("%s link: ZeroMQ IPC sockets in %s", self.name, self._ipc_dir)
        self._addresses = (f"ipc://{self._ipc_dir}/to_engine", f"ipc://{self._ipc_dir}/from_engine")
        self._context = zmq.asyncio.Context()
        self._push = zmq.Socket(self._context, zmq.PUSH)  # sync socket: every send is NOBLOCK
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self._addresses[0])
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(self._addresses[1])
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watch_loop())]
        await self._spawn(EngineState.STARTING)

    async def _spawn(self, state: EngineState) -> None:
        self.incarnation += 1
        self._fatal, self._engine_ready, self.state = None, False, state
        self.state_detail = "loading the model" if state == EngineState.STARTING else "restarting the engine"
        a = self.args
        cfg = EngineProcessConfig(
            a.engine_args, *self._addresses, self.incarnation, a.warmup, a.log_level, a.log_progress_interval,
            replica=self.replica, device_indices=self.device_indices,
        )  # fmt: skip
        name = f"diffserve-engine-{self.replica}-{self.incarnation}"
        process = process_context().Process(target=run_engine_process, args=(cfg,), name=name)
        await asyncio.to_thread(process.start)
        self._process, self.engine_pid = process, process.pid
        logger.info("%s process started (pid %d)", self.name, process.pid)

    @property
    def device_indices(self) -> tuple[int, ...] | None:
        """The accelerator indices this replica's engine uses: `replica * n .. + n - 1` for n devices per
        replica; None with one replica (the engine's own choice, as without --dp-size)."""
        if self.args.dp_size == 1:
            return None
        n = self.args.devices_per_replica
        return tuple(range(self.replica * n, (self.replica + 1) * n))

    def begin_drain(self, timeout: float) -> None:
        """SIGTERM: refuse new requests, give in-flight ones `timeout` seconds, then cancel the rest."""
        if self.state in (EngineState.STOPPING, EngineState.STOPPED):
            return
        self.state, self.state_detail = EngineState.STOPPING, "the server is shutting down"
        self._drain_task = asyncio.create_task(self._drain(timeout))
        self._tasks.append(self._drain_task)

    async def wait_drained(self) -> None:
        """Until the drain `begin_drain` started is over (at once if none was started). Video jobs have
        no connection for the HTTP server to wait on: the app's shutdown waits here before `stop`."""
        if self._drain_task is not None:
            await asyncio.wait({self._drain_task})  # returns, without raising, if `abort` cancelled it

    def abort(self, reason: str) -> None:
        """Stop at once (a second Ctrl-C): kill the engine process, answer every request in flight with
        503 `shutting_down` (`reason` says why), remove the IPC socket folder. `stop` still closes the rest."""
        self.state, self.state_detail = EngineState.STOPPED, reason
        if self._drain_task is not None:
            self._drain_task.cancel()
        self.kill_engine()
        self._fail_all(EngineUnavailableError(reason, code="shutting_down"))

    def fail(self, message: str) -> None:
        """Stop this engine for good (never restarted): kill its process, answer its requests in flight
        with 503 `engine_failed`, and report `on_fatal`. For an engine that must not serve (`ReplicaSet`)."""
        self.state, self.state_detail = EngineState.FAILED, message
        self.kill_engine()
        self._fail_all(self.unavailable_error())
        self.on_fatal(1, message)

    def kill_engine(self) -> None:
        """Kill the engine process (no cleanup there is worth waiting for) and remove the socket folder.
        Synchronous, so it also runs after the event loop is gone: nothing is left for multiprocessing's
        exit-time join to wait on."""
        process, self._process = self._process, None
        if process is not None and process.is_alive():
            logger.warning("Killing the %s process (pid %s)", self.name.lower(), process.pid)
            process.kill()
            process.join(ENGINE_KILL_WAIT_S)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def _drain(self, timeout: float) -> None:
        if n := len(self._pending):
            logger.info("Shutting down: waiting up to %.1f seconds for %d request(s) in flight", timeout, n)
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._pending:
            logger.warning("Shutdown timeout: cancelling %d request(s)", len(self._pending))
            for rid in list(self._pending):
                self._send_nowait(msg.CancelJob(rid))
            message = f"the server is shutting down and cancelled this request after its {timeout:g} s shutdown timeout"
            self._fail_all(EngineUnavailableError(message, code="shutting_down"))

    async def stop(self) -> None:
        self.state, self.state_detail = EngineState.STOPPED, "the server has stopped"
        process = self._process
        if process is not None and process.is_alive():
            if self._engine_ready:  # it listens: let it finish its step and exit cleanly
                self._send_nowait(msg.ShutdownEngine())
                await asyncio.to_thread(process.join, ENGINE_STOP_TIMEOUT_S)
                if process.is_alive():
                    logger.warning(
                        "%s did not stop within %.0f s; terminating it", self.name, ENGINE_STOP_TIMEOUT_S
                    )
            for end in (process.terminate, process.kill):  # still loading (nothing to lose), or stuck
                if process.is_alive():
                    end()
                    await asyncio.to_thread(process.join, 5)
        self._fail_all(EngineUnavailableError("the server has stopped", code="shutting_down"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        logger.info("%s stopped", self.name)

    @property
    def ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def replicas(self) -> tuple[EngineClient]:
        """The replicas behind the front end (`replicas.Engines`): this client alone."""
        return (self,)

    @property
    def num_waiting(self) -> int:
        return sum(1 for p in self._pending.values() if p.started_at is None)

    @property
    def num_running(self) -> int:
        return len(self._pending) - self.num_waiting

    @property
    def free_slots(self) -> int:
        """Running slots the engine has free: unstarted jobs up to this many are about to run, not waiting."""
        return max(0, self.engine_slots - self.num_running)

    @property
    def num_queued(self) -> int:
        """Requests waiting beyond those about to run: what `--max-queue-size` limits. A job counts as
        waiting until the engine reports it started, a step later; counting every unstarted job let a
        burst queue only --max-queue-size minus the running requests. (Jobs the engine's token budget then
        keeps waiting exceed the limit by at most --max-running-requests: in flight stays bounded.)"""
        return max(0, self.num_waiting - self.free_slots)

    def unavailable_error(self) -> EngineUnavailableError:
        if self.state == EngineState.RESTARTING and self._wedge is not None:
            message = f"the engine got stuck ({self._wedge}); the server is restarting it, retry shortly"
            return EngineUnavailableError(message, "engine_wedged")
        if self.state == EngineState.FAILED:
            message = f"the engine failed and will not be restarted: {self.state_detail}"
            return EngineUnavailableError(message, "engine_failed")
        return EngineUnavailableError(*_UNAVAILABLE.get(self.state, _UNAVAILABLE[None]))

    async def _push_job(self, job: msg.GenerateJob, **pending: Any) -> PendingRequest:
        """Register the job and hand it to the engine (raises EngineUnavailableError, QueueFullError).
        A job carrying decoded input images (megabytes) is pickled in a worker thread, not on the event
        loop; the limits are checked after, when it is sent."""
        payload = await _serialized(job)
        if not self.ready:
            raise self.unavailable_error()
        # Every job counts, /health_generate's probe included: an open route must not bypass the limit.
        # One that would wait (no free slot here) is refused when the queue, server-wide, is full.
        queued, limit = self._queued_total(), self.args.max_queue_size
        if self.num_waiting >= self.free_slots and queued >= limit:
            message = f"the queue is full ({queued} requests waiting, --max-queue-size {limit}); retry later"
            raise QueueFullError(message)
        entry = PendingRequest(job, asyncio.get_running_loop().create_future(), time.monotonic(), **pending)
        self._pending[job.request_id] = entry
        try:
            self._push.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._pending.pop(job.request_id, None)
            raise EngineUnavailableError(
                "the engine is not accepting requests right now", "engine_busy"
            ) from None
        return entry

    async def submit(
        self, job: msg.GenerateJob, listener: JobListener | None = None
    ) -> tuple[msg.JobAccepted, asyncio.Future]:
        """For jobs that outlive their HTTP request: the JobAccepted once queued, and the outcome's future."""
        accepted = asyncio.get_running_loop().create_future()
        pending = await self._push_job(replace(job, ack=True), accepted=accepted, listener=listener)
        try:
            return await accepted, pending.future
        except asyncio.CancelledError:
            self.cancel(job.request_id)
            self._pending.pop(job.request_id, None)
            raise

    def add_ready_hook(self, hook: ReadyHook) -> None:
        """Run `hook(info)` each time the engine process reports ready, before it takes requests."""
        self.ready_hooks.append(hook)

    def cancel(self, request_id: str) -> bool:
        """Ask the engine to stop a job; its future then fails with JobCancelledError. False: not in flight."""
        if request_id not in self._pending:
            return False
        self._send_nowait(msg.CancelJob(request_id))
        return True

    async def generate(self, job: msg.GenerateJob) -> msg.JobFinished:
        """Run one job; raises EngineUnavailableError, QueueFullError, JobRejectedError, JobFailedError."""
        pending = await self._push_job(job)
        try:
            return await pending.future
        except asyncio.CancelledError:
            self.cancel(job.request_id)  # the engine has not answered: tell it to stop
            raise
        finally:
            self._pending.pop(job.request_id, None)

    def _send_nowait(self, message: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._push.send_pyobj(message, flags=zmq.NOBLOCK)

    def _resolve(
        self, request_id: str, result: msg.JobFinished | None = None, error: Exception | None = None
    ) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None or pending.future.done():
            return
        if pending.accepted is not None and not pending.accepted.done():
            # Answered before it was accepted (rejected, or the engine died): `submit` raises the error,
            # and nobody will ever await the outcome future.
            error = error or RuntimeError("the engine answered before accepting the job")
            pending.accepted.set_exception(error)
            pending.future.cancel()
            return
        if error is not None:
            pending.future.set_exception(error)
        else:
            self.completed += 1
            pending.future.set_result(result)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._pending):
            self._resolve(rid, error=error)
        self.loras.fail_all(error)

    # -- LoRA admin ops (server/lora_routes.py; the engine's side: engine_loras.py) ---------------------

    async def load_lora(self, name: str, path: str, strict: bool = True) -> msg.LoraOpDone:
        """Load adapter `name` from `path` (relative to --lora-dir); raises LoraOpError (the engine's
        refusal) and EngineUnavailableError."""
        op = msg.LoadLora(new_op_id(), name, path, strict)
        done = await self._lora_op(op)
        self.loras.record(op)
        return done

    async def unload_lora(self, name: str) -> msg.LoraOpDone:
        op = msg.UnloadLora(new_op_id(), name)
        try:
            done = await self._lora_op(op)
        except LoraOpError as exc:
            if exc.status == 404:  # not there: nothing of it to replay either
                self.loras.forget(name)
            raise
        self.loras.record(op)
        return done

    async def list_loras(self) -> msg.LoraOpDone:
        return await self._lora_op(msg.ListLoras(new_op_id()))

    async def _lora_op(self, op: msg.LoadLora | msg.UnloadLora | msg.ListLoras) -> msg.LoraOpDone:
        if not self.ready:
            raise self.unavailable_error()
        done = await self.loras.request(op)
        self.engine_info = {**self.engine_info, "loras": done.loras}  # /server_info's last known state
        return done

    def _send_lora_op(self, op: msg.LoadLora | msg.UnloadLora | msg.ListLoras) -> None:
        try:
            self._push.send_pyobj(op, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            raise EngineUnavailableError(
                "the engine is not accepting requests right now", "engine_busy"
            ) from None

    async def _restore_loras(self, ready: msg.EngineReady) -> None:
        """Replay the LoRA changes on the engine that just reported `ready`, then take requests."""
        incarnation = self.incarnation

        def current() -> bool:
            return self.incarnation == incarnation and self.state in (
                EngineState.STARTING,
                EngineState.RESTARTING,
            )

        state = await self.loras.restore(current)
        if not current():
            return
        if state is not None:
            ready.info = {**ready.info, "loras": state}
        self._become_ready(ready)

    async def _receive_loop(self) -> None:
        while True:
            try:
                incarnation, message = await self._pull.recv_pyobj()
            except Exception:
                logger.exception("Could not read a message from the engine")
                continue
            if incarnation != self.incarnation:
                continue  # from an engine that has since died
            try:
                self._dispatch(message)
            except Exception:
                logger.exception("Could not handle the engine's %s", type(message).__name__)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, msg.EngineHeartbeat):
            self._heartbeat, self._heard_at = message, time.monotonic()
        elif isinstance(message, msg.EngineReady):
            self._on_ready(message)
        elif isinstance(message, msg.EngineFatal):
            self._fatal = message
            logger.error("%s failed to start: %s", self.name, message.message)
        elif isinstance(message, msg.JobFinished):
            if message.batching is not None:  # /server_info's last known curve
                self.engine_info = {**self.engine_info, "batching": message.batching}
            self._resolve(message.request_id, result=message)
        elif isinstance(message, msg.JobRejected):
            error = JobRejectedError(message.message, message.param, message.status)
            self._resolve(message.request_id, error=error)
        elif isinstance(message, msg.JobCancelled):
            self._resolve(message.request_id, error=JobCancelledError(message.at_step))
        elif isinstance(message, msg.JobFailed):
            self._resolve(
                message.request_id, error=JobFailedError(message.message, message.user_error, message.param)
            )
        elif isinstance(message, (msg.LoraOpDone, msg.LoraOpFailed)):
            self.loras.answer(message)
        elif isinstance(
            message, (msg.JobAccepted, msg.JobStarted, msg.JobProgress, msg.JobPreview, msg.JobChunk)
        ):
            if (pending := self._pending.get(message.request_id)) is None:
                return
            if isinstance(message, msg.JobAccepted):
                if pending.accepted is not None and not pending.accepted.done():
                    pending.accepted.set_result(message)
                return
            if isinstance(message, msg.JobStarted):
                pending.started_at = time.monotonic()
                if not pending.job.internal:
                    self.metrics.queue_time.observe(pending.started_at - pending.submitted_at)
            if pending.listener is not None:
                pending.listener(message)
        else:
            logger.warning("Ignoring unknown engine message %r", message)

    def _on_ready(self, message: msg.EngineReady) -> None:
        if self.state not in (EngineState.STARTING, EngineState.RESTARTING):
            return
        if self.loras.changes:  # ready once the adapters of /v1/loras are back
            self.state_detail = "restoring the LoRA adapters loaded through /v1/loras"
            self._tasks.append(asyncio.create_task(self._restore_loras(message)))
            return
        self._become_ready(message)

    def _become_ready(self, message: msg.EngineReady) -> None:
        if self.state not in (EngineState.STARTING, EngineState.RESTARTING):
            return
        self.engine_pid, self.engine_info, self.probe_size = message.pid, message.info, message.probe_size
        self.engine_slots = int((message.info.get("scheduler") or {}).get("max_running_requests") or 0)
        for hook in self.ready_hooks:
            try:
                hook(message.info)
            except Exception as exc:
                logger.exception("The server could not prepare for the engine")
                self.state, self.state_detail = EngineState.FAILED, f"{type(exc).__name__}: {exc}"
                self.on_fatal(1, self.state_detail)
                return
        self.state, self.state_detail = EngineState.READY, ""
        self._heartbeat, self._heard_at, self._wedge = None, time.monotonic(), None
        self._engine_ready = self._ever_ready = True
        self._failed_starts = 0
        a = self.args
        logger.info(
            "%s ready (pid %d): accepting requests on http://%s:%d", self.name, message.pid, a.host, a.port
        )

    async def _watch_loop(self) -> None:
        tick = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            # This event loop held up (a long callback): the engine's heartbeats may wait unread in the
            # socket, so its silence is judged at the next tick, once the receive task has run.
            late, tick = time.monotonic() - tick > WATCH_INTERVAL_S + HEARTBEAT_INTERVAL_S, time.monotonic()
            process = self._process
            if process is None or self.state == EngineState.STOPPED:
                continue
            if not process.is_alive():
                await self._on_engine_exit(process)
            elif not late and (wedge := self._wedged()) is not None:
                await self._restart_stuck(process, wedge)

    def _wedged(self) -> str | None:
        """Why the ready engine counts as stuck, or None: its longest turn in progress (a step, a message,
        an admission) at its last heartbeat, plus the time since, exceeds --engine-watchdog-seconds; or
        its heartbeats stopped that long ago (a frozen process). Starting, restarting and draining
        engines are not watched (loading has no heartbeat; the drain has its own timeout)."""
        limit = self.args.engine_watchdog_seconds
        if not limit or self.state != EngineState.READY:
            return None
        silent = time.monotonic() - self._heard_at
        beat = self._heartbeat
        stalled = silent + (beat.stalled_seconds if beat is not None else 0.0)
        if stalled <= limit:
            return None
        if beat is None or silent > 3 * HEARTBEAT_INTERVAL_S:
            what = f"no heartbeat from its process for {silent:.0f} s"
        else:
            what = f"{beat.doing} has lasted {stalled:.0f} s"
        return f"{what}, over --engine-watchdog-seconds {limit:g}"

    async def _restart_stuck(self, process: multiprocessing.process.BaseProcess, wedge: str) -> None:
        """Kill the stuck engine process, then restart it as one that died (`_on_engine_exit`): its
        requests in flight get 503 `engine_died`, /health says why (`engine_wedged`) until it is back."""
        logger.error(
            "%s is stuck: %s; killing its process (pid %s) to restart it", self.name, wedge, process.pid
        )
        self._wedge = wedge
        process.kill()
        await asyncio.to_thread(process.join, ENGINE_KILL_WAIT_S)
        if self.state != EngineState.STOPPED:  # `stop` ran meanwhile: it answers what was in flight
            await self._on_engine_exit(process, cause=f"was killed because it was stuck ({wedge})")

    async def _on_engine_exit(
        self, process: multiprocessing.process.BaseProcess, cause: str | None = None
    ) -> None:
        """The engine process exited (or was killed, `cause` says why): answer what was in flight, then
        restart it, with backoff while restarts keep failing, or give up."""
        self._process, self._engine_ready = None, False
        code, pid, fatal = process.exitcode, process.pid, self._fatal
        stopping = self.state == EngineState.STOPPING
        then = "the server is shutting down" if stopping else "the server is restarting it, retry shortly"
        died = f"the engine process (pid {pid}) {cause or f'exited with code {code}'}"
        for rid, pending in list(self._pending.items()):  # each told whether it had started there
            started = pending.started_at is not None
            where = (
                "while this request was running (it had started: its work is lost)"
                if started
                else "before this request started"
            )
            self._resolve(rid, error=EngineDiedError(f"{died} {where}; {then}", started))
        self.loras.fail_all(EngineUnavailableError(f"{died}; {then}", code="engine_died"))
        if stopping:
            logger.warning("%s process (pid %s) exited with code %s during shutdown", self.name, pid, code)
            return
        if not self._ever_ready:
            message = fatal.message if fatal else f"the engine process exited with code {code} while starting"
            self.state, self.state_detail = EngineState.FAILED, message
            self.on_fatal(2 if fatal is not None and fatal.user_error else 1, message)
            return
        self._failed_starts += 1 if self.state == EngineState.RESTARTING else 0
        if self._failed_starts >= self.args.max_engine_restarts:
            message = f"the engine failed to restart {self._failed_starts} times in a row" + (
                f"; last error: {fatal.message}" if fatal else f"; last exit code {code}"
            )
            self.state, self.state_detail = EngineState.FAILED, message
            self.on_fatal(1, message)
            return
        delay = 0.0 if self._failed_starts == 0 else min(30.0, 2.0 ** (self._failed_starts - 1))
        in_delay = f" in {delay:g} s" if delay else ""
        logger.error(
            "%s process (pid %s) exited with code %s; restarting it%s", self.name, pid, code, in_delay
        )
        self.state, self.state_detail = EngineState.RESTARTING, "restarting the engine"
        self.restarts += 1
        self.metrics.engine_restarts.inc()
        if delay:
            await asyncio.sleep(delay)
        if self.state == EngineState.RESTARTING:
            await self._spawn(EngineState.RESTARTING)
