"""Data-parallel replicas (`--dp-size N`): N engine processes, each with its own copy of the model, behind
the one HTTP front end.

Each replica is an `EngineClient` (its own engine process, sockets, restarts with backoff, drain). The
`ReplicaSet` sends each new request (image, video job, /health_generate probe) to the least-loaded ready
replica, ties taken in turn, and the request stays there: its cancel, previews and progress go through
that replica's client. `--max-queue-size` counts the waiting requests of every replica. A replica that
dies restarts while the others serve: the requests it had not started are sent to another ready replica
(the least loaded, in queue there as new), the ones it was running fail (503 `engine_died`, saying they
had started); the server gives up only when every replica has failed for good.

LoRA admin ops apply to every replica: a load or unload is sent to each ready replica (a load that fails
on one is undone on the others, and the failure answered), and kept for the replicas that are starting
or restarting, which replay it before they take requests (`lora_client.py`); listing asks one replica.

The routes, the video jobs and the signal handling see the engine side as `Engines`: one `EngineClient`
with one replica (exactly as before), a `ReplicaSet` with more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import (
    EngineClient,
    EngineDiedError,
    EngineState,
    EngineUnavailableError,
    JobListener,
    ReadyHook,
)
from diffserve.server.lora_client import LoraOpError, new_op_id
from diffserve.server.metrics import ServerMetrics
from diffserve.server.replica_loras import load_on_all_or_none, on_replica

logger = logging.getLogger("diffserve.server")

#: Which replica's state a request is told about when none is ready: the most hopeful first.
_STATE_ORDER = (
    EngineState.READY,
    EngineState.RESTARTING,
    EngineState.STARTING,
    EngineState.STOPPING,
    EngineState.STOPPED,
    EngineState.FAILED,
)


class Engines(Protocol):
    """What the routes, the video jobs and the runner use of the engine side."""

    @property
    def ready(self) -> bool: ...
    @property
    def state(self) -> EngineState: ...
    @property
    def state_detail(self) -> str: ...
    @property
    def engine_info(self) -> dict[str, Any]: ...
    @property
    def probe_size(self) -> int: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def replicas(self) -> Sequence[EngineClient]: ...

    def unavailable_error(self) -> EngineUnavailableError: ...
    async def submit(
        self, job: msg.GenerateJob, listener: JobListener | None = None
    ) -> tuple[msg.JobAccepted, asyncio.Future]: ...
    async def generate(self, job: msg.GenerateJob) -> msg.JobFinished: ...
    def cancel(self, request_id: str) -> bool: ...
    async def load_lora(self, name: str, path: str, strict: bool = True) -> msg.LoraOpDone: ...
    async def unload_lora(self, name: str) -> msg.LoraOpDone: ...
    async def list_loras(self) -> msg.LoraOpDone: ...
    def add_ready_hook(self, hook: ReadyHook) -> None: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def begin_drain(self, timeout: float) -> None: ...
    async def wait_drained(self) -> None: ...
    def abort(self, reason: str) -> None: ...
    def kill_engine(self) -> None: ...


class ReplicaMismatchError(RuntimeError):
    """A replica's engine runs on another platform than the others (it found no device of its own)."""


def choose_replica(loads: Sequence[int | None], first: int) -> int | None:
    """The replica to send a new request to: the least loaded (`loads`: requests waiting or running; None:
    not ready), ties broken in turn, from index `first` on; None when no replica is ready."""
    best: int | None = None
    best_load = 0
    for k in range(len(loads)):
        i = (first + k) % len(loads)
        load = loads[i]
        if load is not None and (best is None or load < best_load):
            best, best_load = i, load
    return best


class ReplicaSet:
    """`dp_size` engine clients and the routing between them (module docstring)."""

    def __init__(
        self,
        args: ServerArgs,
        metrics: ServerMetrics,
        on_fatal: Callable[[int, str], None],
    ) -> None:
        self.args, self._on_fatal = args, on_fatal
        self.clients: list[EngineClient] = [
            EngineClient(args, metrics, self._fatal_handler(i), replica=i, queued_total=self._num_queued)
            for i in range(args.dp_size)
        ]
        for client in self.clients:
            client.add_ready_hook(self._platform_check(client))
        #: The replica each request in flight was sent to, by request id.
        self._owner: dict[str, EngineClient] = {}
        self._next = 0  # where the next tie-break starts
        self._failed: dict[int, tuple[int, str]] = {}
        self._resends: set[asyncio.Task] = set()  # video jobs being sent to another replica

    # -- routing -----------------------------------------------------------------------------------
    def loads(self) -> list[int | None]:
        """Requests sent to each replica and not answered yet; None for a replica that is not ready."""
        sent = Counter(id(client) for client in self._owner.values())
        return [sent[id(c)] if c.ready else None for c in self.clients]

    def route(self, exclude: Sequence[EngineClient] = ()) -> EngineClient:
        """The least-loaded ready replica not in `exclude` (raises EngineUnavailableError when none is)."""
        loads = [None if c in exclude else load for c, load in zip(self.clients, self.loads(), strict=True)]
        index = choose_replica(loads, self._next)
        if index is None:
            raise self.unavailable_error()
        self._next = (index + 1) % len(self.clients)
        return self.clients[index]

    def _reroute(
        self, job: msg.GenerateJob, error: EngineDiedError, died: list[EngineClient]
    ) -> EngineClient:
        """The replica to send `job` to after `died[-1]` died before starting it; raises `error` (saying
        no other replica could take it) when none is ready."""
        try:
            client = self.route(exclude=died)
        except EngineUnavailableError:
            raise EngineDiedError(f"{error}; no other replica was ready to take it", started=False) from None
        logger.warning(
            "Replica %d died before request %s started: sent to replica %d",
            died[-1].replica, job.request_id, client.replica,
        )  # fmt: skip
        return client

    async def _submit_to(
        self,
        job: msg.GenerateJob,
        listener: JobListener | None,
        died: list[EngineClient],
        client: EngineClient | None = None,
    ) -> tuple[EngineClient, msg.JobAccepted, asyncio.Future]:
        """`EngineClient.submit` on `client` (None: the route's choice, not one of `died`); sent on when
        that replica dies before accepting the job."""
        rid = job.request_id
        client = client or self.route(exclude=died)
        while True:
            self._owner[rid] = client
            try:
                accepted, outcome = await client.submit(job, listener)
            except EngineDiedError as exc:
                died.append(client)
                client = self._reroute(job, exc, died)
                continue
            return client, accepted, outcome

    async def submit(
        self, job: msg.GenerateJob, listener: JobListener | None = None
    ) -> tuple[msg.JobAccepted, asyncio.Future]:
        """`EngineClient.submit` on the chosen replica; the job stays there until its outcome, unless that
        replica dies before the job starts: then it is sent to another ready one (same seed), and the
        returned outcome is the last replica's."""
        rid, died = job.request_id, []
        try:
            client, accepted, outcome = await self._submit_to(job, listener, died)
        except BaseException:
            self._owner.pop(rid, None)
            raise
        # Sent again, the job keeps the seed it was accepted with (what its record shows).
        again = dataclasses.replace(job, params=dataclasses.replace(job.params, seed=accepted.params.seed))
        result: asyncio.Future = asyncio.get_running_loop().create_future()
        result.add_done_callback(lambda _: self._owner.pop(rid, None))
        self._follow(again, listener, client, outcome, result, died)
        return accepted, result

    def _follow(
        self,
        job: msg.GenerateJob,
        listener: JobListener | None,
        client: EngineClient,
        outcome: asyncio.Future,
        result: asyncio.Future,
        died: list[EngineClient],
    ) -> None:
        """Pass `outcome` (from `client`) on to `result`, or send the job to another replica when `client`
        died before starting it."""

        def done(future: asyncio.Future) -> None:
            if result.done():
                return
            if future.cancelled():
                result.cancel()
                return
            error = future.exception()
            if isinstance(error, EngineDiedError) and not error.started:
                died.append(client)
                task = asyncio.get_running_loop().create_task(
                    self._resend(job, listener, result, error, died)
                )
                self._resends.add(task)
                task.add_done_callback(self._resends.discard)
            elif error is not None:
                result.set_exception(error)
            else:
                result.set_result(future.result())

        outcome.add_done_callback(done)

    async def _resend(
        self,
        job: msg.GenerateJob,
        listener: JobListener | None,
        result: asyncio.Future,
        error: EngineDiedError,
        died: list[EngineClient],
    ) -> None:
        try:
            client, _, outcome = await self._submit_to(job, listener, died, self._reroute(job, error, died))
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._follow(job, listener, client, outcome, result, died)

    async def generate(self, job: msg.GenerateJob) -> msg.JobFinished:
        """`EngineClient.generate` on the chosen replica; sent to another ready replica when the chosen
        one dies before starting it."""
        rid, died = job.request_id, []
        client = self.route()
        try:
            while True:
                self._owner[rid] = client
                try:
                    return await client.generate(job)
                except EngineDiedError as exc:
                    if exc.started:
                        raise
                    died.append(client)
                    client = self._reroute(job, exc, died)
        finally:
            self._owner.pop(rid, None)

    def cancel(self, request_id: str) -> bool:
        client = self._owner.get(request_id)
        return client is not None and client.cancel(request_id)

    # -- LoRA admin ops ----------------------------------------------------------------------------
    def _lora_targets(self) -> tuple[list[EngineClient], list[EngineClient]]:
        """The ready replicas an op is sent to, and those starting or restarting that replay it later
        (a replica that failed for good or stops gets nothing); 503 when none is ready."""
        ready = [c for c in self.clients if c.ready]
        if not ready:
            raise self.unavailable_error()
        later = [c for c in self.clients if c.state in (EngineState.STARTING, EngineState.RESTARTING)]
        return ready, later

    async def load_lora(self, name: str, path: str, strict: bool = True) -> msg.LoraOpDone:
        """Load on every ready replica, or on none: where it loaded it is unloaded again when another
        replica refused it, and that refusal is the answer."""
        ready, later = self._lora_targets()
        done = await load_on_all_or_none(
            ready,
            lambda c: c.load_lora(name, path, strict),
            lambda c: c.unload_lora(name),
            lambda c: c.replica,
            name,
        )
        for client in later:
            client.loras.record(msg.LoadLora(new_op_id(), name, path, strict))
        return done

    async def unload_lora(self, name: str) -> msg.LoraOpDone:
        """Unload from every ready replica: 404 when none had it, a replica's refusal (409: in use there)
        when one still has it, the replicas that unloaded it named in the message."""
        ready, later = self._lora_targets()
        results = await asyncio.gather(*(c.unload_lora(name) for c in ready), return_exceptions=True)
        done = [r for r in results if isinstance(r, msg.LoraOpDone)]
        unloaded = [c.replica for c, r in zip(ready, results, strict=True) if isinstance(r, msg.LoraOpDone)]
        refusals = [
            (c, r) for c, r in zip(ready, results, strict=True)
            if isinstance(r, BaseException) and not (isinstance(r, LoraOpError) and r.status == 404)
        ]  # fmt: skip
        for client in later:  # replayed when it had been loaded anywhere; else nothing to keep
            if done:
                client.loras.record(msg.UnloadLora(new_op_id(), name))
            else:
                client.loras.forget(name)
        if refusals:
            client, error = refusals[0]
            if not isinstance(error, Exception):
                raise error
            where = (
                f"unloaded from replica(s) {', '.join(map(str, unloaded))}"
                if unloaded
                else "unloaded from none"
            )
            raise on_replica(client.replica, error, f"LoRA {name!r} was {where}")
        if not done:
            raise next(r for r in results if isinstance(r, BaseException))  # every replica's 404
        return done[0]

    async def list_loras(self) -> msg.LoraOpDone:
        """One ready replica's adapters (every replica serves the same ones)."""
        return await self._lora_targets()[0][0].list_loras()

    def _num_queued(self) -> int:
        """Requests waiting beyond free running slots, on every replica: what --max-queue-size limits."""
        return sum(client.num_queued for client in self.clients)

    # -- state -------------------------------------------------------------------------------------
    @property
    def replicas(self) -> Sequence[EngineClient]:
        return self.clients

    @property
    def ready(self) -> bool:
        return any(client.ready for client in self.clients)

    def _representative(self) -> EngineClient:
        """A ready replica if any, else the one in the most hopeful state (what a client is told)."""
        return min(self.clients, key=lambda c: _STATE_ORDER.index(c.state))

    @property
    def state(self) -> EngineState:
        return self._representative().state

    @property
    def state_detail(self) -> str:
        return self._representative().state_detail

    @property
    def engine_info(self) -> dict[str, Any]:
        """The model as a ready replica reported it (every replica serves the same model)."""
        return self._representative().engine_info

    @property
    def probe_size(self) -> int:
        return self._representative().probe_size

    @property
    def incarnation(self) -> int:
        """Changes whenever any replica's engine process is (re)started: a reused probe result is stale."""
        return sum(client.incarnation for client in self.clients)

    @property
    def num_waiting(self) -> int:
        return sum(client.num_waiting for client in self.clients)

    @property
    def num_running(self) -> int:
        return sum(client.num_running for client in self.clients)

    def unavailable_error(self) -> EngineUnavailableError:
        return self._representative().unavailable_error()

    def add_ready_hook(self, hook: ReadyHook) -> None:
        for client in self.clients:
            client.add_ready_hook(hook)

    def _platform_check(self, client: EngineClient) -> ReadyHook:
        """A ready hook: a replica must run on replica 0's platform. Replica 0's devices exist whenever the
        machine has any; another replica that found none of its own detected another platform (the CPU),
        and is refused rather than serving slowly: when it reports ready after replica 0, or when replica
        0 reports ready after it."""

        def check(info: dict[str, Any]) -> None:
            first = self.clients[0]
            if client is first:
                for other in self.clients[1:]:
                    if other.ready and (why := self._mismatch(other.replica, other.engine_info, info)):
                        other.fail(why)
            elif first.engine_info and (why := self._mismatch(client.replica, info, first.engine_info)):
                raise ReplicaMismatchError(why)

        return check

    def _mismatch(self, replica: int, info: dict[str, Any], first: dict[str, Any]) -> str | None:
        """Why replica `replica` (reporting `info`) cannot serve next to replica 0 (`first`), or None."""
        ours, theirs = info.get("platform"), first.get("platform")
        if ours == theirs:
            return None
        n, dp = self.args.devices_per_replica, self.args.dp_size
        return (
            f"replica {replica} runs on {ours} but replica 0 on {theirs}: --dp-size {dp} needs {dp * n} "
            f"{theirs} devices (replica i uses device indices from i x {n})"
        )

    def _fatal_handler(self, index: int) -> Callable[[int, str], None]:
        """A replica failed for good: the server stops only once every replica has."""

        def on_fatal(code: int, message: str) -> None:
            self._failed[index] = (code, message)
            logger.error("Replica %d failed and will not be restarted: %s", index, message)
            self.clients[index].kill_engine()  # a process still up (refused by a ready hook) serves no one
            if len(self._failed) == len(self.clients):
                codes = [code for code, _ in self._failed.values()]
                reasons = "; ".join(f"replica {i}: {m}" for i, (_, m) in sorted(self._failed.items()))
                self._on_fatal(min(codes), f"every replica failed: {reasons}")

        return on_fatal

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(client.start() for client in self.clients))

    async def stop(self) -> None:
        await asyncio.gather(*(client.stop() for client in self.clients))

    def begin_drain(self, timeout: float) -> None:
        for client in self.clients:
            client.begin_drain(timeout)

    async def wait_drained(self) -> None:
        await asyncio.gather(*(client.wait_drained() for client in self.clients))

    def abort(self, reason: str) -> None:
        for client in self.clients:
            client.abort(reason)

    def kill_engine(self) -> None:
        for client in self.clients:
            client.kill_engine()
