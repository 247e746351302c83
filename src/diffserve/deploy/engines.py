"""`RayEngines`: the server's engine side (`server/replicas.Engines`) over one model's Ray Serve replicas.

The ingress runs diffserve's own FastAPI app (server/app.py) with this in place of the engine process,
so every route answers as the single server's. What goes where:

- jobs (`submit`, `generate`): through the deployment's handle as streaming calls, each followed by a
  `RemoteJob` (remote_job.py); Ray Serve's request router (router.py) picks the replica with the fewest
  waiting steps, and a job stays on its replica: its cancel, previews and progress go through it;
- `cancel` and the LoRA ops: calls for one replica (`replica_id=`, which the router honours). A load or
  an unload goes to every running replica (a load that fails on one is undone on the others, and its
  failure answered, as `--dp-size`'s `ReplicaSet`); what succeeded is kept in a `LoraLog` that travels
  with every job, so replicas started later serve the same adapters (lora_log.py);
- the replicas' state and load: the reports the router receives (`record_routing_stats`), read every
  `STATS_PERIOD_S` by a watch task, which also asks each new replica (or restarted engine) for its engine
  info and runs the ready hooks (the video job store opens on the first video model).

`--max-queue-size` holds per replica here (each replica's engine client counts its own queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from diffserve.deploy.lora_log import LoraLog
from diffserve.deploy.messages import ReplicaFailure
from diffserve.deploy.remote_job import RemoteJob
from diffserve.deploy.router import STATS_PERIOD_S
from diffserve.deploy.router_registry import ReplicaView, router_for
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineState, EngineUnavailableError, JobListener, ReadyHook
from diffserve.server.lora_client import LoraOpError, new_op_id
from diffserve.server.metrics import ServerMetrics
from diffserve.server.replica_loras import load_on_all_or_none, on_replica

logger = logging.getLogger("diffserve.server")

#: How long a call for one replica (cancel, LoRA op, info) may take before it counts as failed.
TARGET_TIMEOUT_S = 60.0
#: Which replica's state a request is told about when none is ready: the most hopeful first.
_STATE_ORDER = (EngineState.READY, EngineState.RESTARTING, EngineState.STARTING, EngineState.STOPPING,
                EngineState.STOPPED, EngineState.FAILED)  # fmt: skip


@dataclass
class RemoteReplica:
    """One running replica as /server_info and the per-replica metrics read it (the attributes of an
    `EngineClient` that `status_routes.replica_info` and `ServerMetrics.track_replicas` use)."""

    replica: str
    node_id: str
    stats: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    probe_size: int = 64
    info_incarnation: int | None = None  # the engine incarnation `info` came from
    device_indices: None = None  # Ray gives each replica its devices

    @property
    def engine_state(self) -> EngineState:
        """Its engine's state, as its last report says (ready until the first report: Ray Serve runs a
        replica once its engine is ready)."""
        return EngineState(self.stats.get("state", EngineState.READY.value))

    @property
    def state(self) -> EngineState:
        """Its engine's state, but starting until the ingress has its engine's info (the routes need it)."""
        return (
            self.engine_state if self.info or self.engine_state != EngineState.READY else EngineState.STARTING
        )

    @property
    def ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def state_detail(self) -> str:
        if self.state == EngineState.STARTING and self.engine_state == EngineState.READY:
            return "running; the ingress is reading its engine's report"
        return str(self.stats.get("detail", ""))

    @property
    def engine_pid(self) -> int | None:
        return self.stats.get("engine_pid")

    @property
    def restarts(self) -> int:
        return int(self.stats.get("restarts", 0))

    @property
    def num_waiting(self) -> int:
        return int(self.stats.get("waiting", 0))

    @property
    def num_running(self) -> int:
        return int(self.stats.get("running", 0))

    @property
    def completed(self) -> int:
        return int(self.stats.get("completed", 0))

    @property
    def engine_info(self) -> dict[str, Any]:
        """Its engine's report, with where it runs (`node`: /server_info's per-replica entry)."""
        node = {
            "id": self.node_id,
            "hostname": self.stats.get("hostname"),
            "replica_pid": self.stats.get("replica_pid"),
        }
        return {**self.info, "node": node}


class RayEngines:
    """One model's replicas behind the ingress's app (module docstring)."""

    def __init__(
        self, handle: DeploymentHandle, deployment: str, args: ServerArgs, metrics: ServerMetrics
    ) -> None:
        self.handle, self.deployment, self.args, self.metrics = handle, deployment, args, metrics
        self.output_dir = args.output_dir
        self._jobs: dict[str, RemoteJob] = {}
        self._replicas: dict[str, RemoteReplica] = {}
        self._hooks: list[ReadyHook] = []
        self._info: dict[str, Any] = {}
        self._probe_size = 64
        self._incarnation = 0
        self._log = LoraLog()
        self._stopping: tuple[EngineState, str] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._watch_task: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None
        self._first_call: asyncio.Task | None = None

    # -- calls to the replicas ---------------------------------------------------------------------
    def send(self, job: msg.GenerateJob) -> Any:
        """A job's stream from the replica Ray's router picks, the LoRA log along (RemoteJob's owner)."""
        return outside_request(self.handle.options(stream=True).submit.remote, job, self._log)

    async def _call(self, replica: str, method: str, *args: Any) -> Any:
        """`method(*args)` on replica `replica`; a ReplicaFailure answer raised as its error, a lost
        replica as EngineUnavailableError naming it."""
        try:
            call = outside_request(getattr(self.handle, method).remote, *args, replica_id=replica)
            answer = await asyncio.wait_for(call, TARGET_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as exc:
            raise EngineUnavailableError(f"replica {replica} did not answer: {exc or 'timed out'}", "engine_unavailable") from None  # fmt: skip
        if isinstance(answer, ReplicaFailure):
            raise answer.error()
        return answer

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel_on(self, replica_id: str, request_id: str) -> None:
        async def cancel() -> None:
            try:
                await self._call(replica_id, "cancel", request_id)
            except Exception as exc:
                logger.warning(
                    "Request %s: could not cancel it on replica %s: %s", request_id, replica_id, exc
                )

        self._spawn(cancel())

    # -- jobs --------------------------------------------------------------------------------------
    async def submit(
        self, job: msg.GenerateJob, listener: JobListener | None = None
    ) -> tuple[msg.JobAccepted, asyncio.Future]:
        """Send the job to a replica: its JobAccepted, and the future of its outcome (remote_job.py)."""
        if self._stopping is not None or not self.ready:
            raise self.unavailable_error()
        remote = RemoteJob(self, job, listener)
        self._jobs[job.request_id] = remote
        try:
            accepted = await remote.start()
        except asyncio.CancelledError:
            remote.abandon(EngineUnavailableError("the request was cancelled", "cancelled"))
            self._jobs.pop(job.request_id, None)
            raise
        except BaseException:
            self._jobs.pop(job.request_id, None)
            raise
        remote.on_done(lambda done: self._jobs.pop(done.request_id, None))
        return accepted, remote.outcome

    async def generate(self, job: msg.GenerateJob) -> msg.JobFinished:
        """Run one job to its end; cancelled (the client left), it is cancelled on its replica."""
        _, outcome = await self.submit(job)
        try:
            return await asyncio.shield(outcome)
        except asyncio.CancelledError:
            self.cancel(job.request_id)
            outcome.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise

    def cancel(self, request_id: str) -> bool:
        remote = self._jobs.get(request_id)
        return remote is not None and remote.cancel()

    # -- LoRA admin ops ----------------------------------------------------------------------------
    def _ready_replicas(self) -> list[RemoteReplica]:
        ready = [r for r in self._replicas.values() if r.ready]
        if not ready:
            raise self.unavailable_error()
        return ready

    async def load_lora(self, name: str, path: str, strict: bool = True) -> msg.LoraOpDone:
        """Load on every running replica, or on none: where it loaded it is unloaded again when another
        replica refused it, and that refusal is the answer."""
        done = await load_on_all_or_none(
            self._ready_replicas(),
            lambda r: self._call(r.replica, "load_lora", name, path, strict),
            lambda r: self._call(r.replica, "unload_lora", name),
            lambda r: r.replica,
            name,
        )
        self._log = self._log.recorded(msg.LoadLora(new_op_id(), name, path, strict))
        return done

    async def unload_lora(self, name: str) -> msg.LoraOpDone:
        """Unload from every running replica: 404 when none had it, a replica's refusal (409: in use
        there) when one still has it."""
        ready = self._ready_replicas()
        results = await asyncio.gather(*(self._call(r.replica, "unload_lora", name) for r in ready), return_exceptions=True)  # fmt: skip
        done = [r for r in results if isinstance(r, msg.LoraOpDone)]
        refusals = [
            (replica, r) for replica, r in zip(ready, results, strict=True)
            if isinstance(r, BaseException) and not (isinstance(r, LoraOpError) and r.status == 404)
        ]  # fmt: skip
        if done:
            self._log = self._log.recorded(msg.UnloadLora(new_op_id(), name))
        if refusals:
            replica, error = refusals[0]
            if not isinstance(error, Exception):
                raise error
            where = f"unloaded from {len(done)} of {len(ready)} replicas"
            raise on_replica(replica.replica, error, f"LoRA {name!r} was {where}")
        if not done:
            raise next(r for r in results if isinstance(r, BaseException))  # every replica's 404
        return done[0]

    async def list_loras(self) -> msg.LoraOpDone:
        """One replica's adapters (every replica serves the same ones: it catches up with the log first)."""
        self._ready_replicas()
        try:
            answer = await asyncio.wait_for(
                outside_request(self.handle.list_loras.remote, self._log), TARGET_TIMEOUT_S
            )
        except (RayError, asyncio.TimeoutError) as exc:
            raise EngineUnavailableError(f"no replica answered: {exc or 'timed out'}", "engine_unavailable") from None  # fmt: skip
        if isinstance(answer, ReplicaFailure):
            raise answer.error()
        return answer

    # -- the replicas' state -----------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:
                self._refresh()
            except Exception:
                logger.exception("Could not read the state of %s's replicas", self.args.model_id)
            await asyncio.sleep(STATS_PERIOD_S)

    def _refresh(self) -> None:
        """Take in the router's view of the replicas (router.py); ask new engines for their info."""
        router = router_for(self.deployment)
        if router is None:  # the handle makes its router on its first call: this one
            if self._first_call is None or self._first_call.done():
                self._first_call = asyncio.get_running_loop().create_task(self._first_info())
            return
        views = {view.replica_id: view for view in router.replicas()}
        for gone in set(self._replicas) - set(views):
            self._replicas.pop(gone)
            self._forget_metrics(gone)
            logger.warning("Replica %s of %s is gone", gone, self.args.model_id)
        for view in views.values():
            self._take_in(view)

    def _take_in(self, view: ReplicaView) -> None:
        replica = self._replicas.get(view.replica_id)
        if replica is None:
            replica = self._replicas[view.replica_id] = RemoteReplica(view.replica_id, view.node_id)
            self.metrics.track_replicas([replica])
            logger.info(
                "Replica %s of %s is running on node %s", view.replica_id, self.args.model_id, view.node_id
            )
        replica.node_id, replica.stats = view.node_id, view.stats
        incarnation = view.stats.get("incarnation")
        if incarnation != replica.info_incarnation and replica.engine_state == EngineState.READY:
            replica.info_incarnation = incarnation
            self._spawn(self._fetch_info(replica))

    async def _first_info(self) -> None:
        try:
            report = await outside_request(self.handle.info.remote)
        except RayError as exc:
            logger.warning("%s: no replica answered yet: %s", self.args.model_id, exc)
            return
        self._remember(report)

    async def _fetch_info(self, replica: RemoteReplica) -> None:
        try:
            report = await self._call(replica.replica, "info")
        except Exception as exc:
            replica.info_incarnation = None  # asked again at the next refresh
            logger.warning("Replica %s: could not read its engine info: %s", replica.replica, exc)
            return
        for hook in self._hooks:
            try:
                hook(report["engine_info"])
            except Exception:
                logger.exception("The server could not prepare for replica %s's engine", replica.replica)
                return
        replica.info, replica.probe_size = report["engine_info"], report["probe_size"]
        self._remember(report)

    def _remember(self, report: dict[str, Any]) -> None:
        self._info, self._probe_size = report["engine_info"], report["probe_size"]
        self._incarnation += 1

    def _forget_metrics(self, replica_id: str) -> None:
        for gauge in (
            self.metrics.replica_queue_depth,
            self.metrics.replica_running,
            self.metrics.replica_up,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(replica_id)

    @property
    def replicas(self) -> Sequence[RemoteReplica]:
        return list(self._replicas.values())

    @property
    def ready(self) -> bool:
        return self._stopping is None and any(r.ready for r in self._replicas.values())

    def _representative(self) -> RemoteReplica | None:
        replicas = list(self._replicas.values())
        return min(replicas, key=lambda r: _STATE_ORDER.index(r.state)) if replicas else None

    @property
    def state(self) -> EngineState:
        if self._stopping is not None:
            return self._stopping[0]
        if self.ready:
            return EngineState.READY
        replica = self._representative()
        return (
            EngineState.STARTING if replica is None or replica.state == EngineState.READY else replica.state
        )

    @property
    def state_detail(self) -> str:
        if self._stopping is not None:
            return self._stopping[1]
        replica = self._representative()
        if self.ready:
            return ""
        if replica is None or replica.state == EngineState.READY:
            return f"Ray Serve is starting the replicas of {self.args.model_id}"
        return replica.state_detail

    @property
    def engine_info(self) -> dict[str, Any]:
        return self._info

    @property
    def probe_size(self) -> int:
        return self._probe_size

    @property
    def incarnation(self) -> int:
        """Changes whenever a replica (or a replica's engine) is new: a reused probe result is stale."""
        return self._incarnation

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self._replicas.values())

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self._replicas.values())

    def unavailable_error(self) -> EngineUnavailableError:
        state, model = self.state, self.args.model_id
        if state in (EngineState.STOPPING, EngineState.STOPPED):
            return EngineUnavailableError("the server is shutting down", "shutting_down")
        if state == EngineState.RESTARTING:
            message = f"every replica of {model} is restarting its engine; retry shortly"
            return EngineUnavailableError(message, "engine_restarting")
        if state == EngineState.FAILED:
            return EngineUnavailableError(
                f"the replicas of {model} failed: {self.state_detail}", "engine_failed"
            )
        message = f"no replica of {model} is ready yet (Ray Serve is starting them: loading the model and warming up); retry shortly"  # fmt: skip
        return EngineUnavailableError(message, "engine_starting")

    def add_ready_hook(self, hook: ReadyHook) -> None:
        self._hooks.append(hook)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    def begin_drain(self, timeout: float) -> None:
        if self._stopping is not None:
            return
        self._stopping = (EngineState.STOPPING, "the server is shutting down")
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._jobs:
            message = f"the server is shutting down and cancelled this request after its {timeout:g} s shutdown timeout"
            self._abandon_all(EngineUnavailableError(message, "shutting_down"))

    async def wait_drained(self) -> None:
        if self._drain_task is not None:
            await asyncio.wait({self._drain_task})

    def _abandon_all(self, error: Exception) -> None:
        for remote in list(self._jobs.values()):
            remote.abandon(error)
        self._jobs.clear()

    def abort(self, reason: str) -> None:
        self._stopping = (EngineState.STOPPED, reason)
        if self._drain_task is not None:
            self._drain_task.cancel()
        self._abandon_all(EngineUnavailableError(reason, "shutting_down"))

    async def stop(self) -> None:
        self._stopping = (EngineState.STOPPED, "the server has stopped")
        self._abandon_all(EngineUnavailableError("the server has stopped", "shutting_down"))
        tasks = [t for t in (self._watch_task, self._first_call, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def kill_engine(self) -> None:
        """Nothing to kill here: Ray Serve owns the replicas and their engine processes."""


def outside_request(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)` (a handle's `.remote`) outside the HTTP request being served: Ray Serve
    gives a call made inside a request that request's internal id, and its router matches replies to
    calls by that id, so two calls of one request at once (a LoRA op sent to every replica, a cancel
    next to its job) would be taken for one. A fresh context gives each call its own id."""
    return contextvars.Context().run(call, *args, **kwargs)
