"""`EngineReplica`: one Ray Serve replica owning one diffserve engine, exactly as `diffserve serve` runs it.

The replica is a front end without HTTP: an `EngineClient` (server/engine_client.py) spawns the engine
process (which may start its own rank processes: a replica may be multi-rank), supervises it (restarts
with backoff), and talks to it over ZeroMQ; step batching, admission, previews and LoRA are the
engine's. The constructor returns once the engine has loaded the model and warmed up, so Ray Serve sends
a new or replacement replica no traffic before it can serve. An engine that fails for good fails the
replica's health check, and Ray Serve replaces the replica.

Methods (called by the ingress through the deployment's handle, engines.py):
- `submit(job, loras)`: a streaming call (`handle.options(stream=True)`): `Placed`, then the engine's
  messages for the job (JobAccepted, JobStarted, JobPreview, and a video job's JobProgress), then its
  JobFinished (a video's MP4 as `FinishedVideo`) or a `ReplicaFailure` (messages.py). The replica first catches up with the
  LoRA log the job carries (lora_log.py). The call cancelled (client gone) cancels the job in the engine.
- `cancel`, `load_lora`, `unload_lora`, `list_loras`, `info`: targeted at one replica with `replica_id`
  (router.py), which the replica checks is its own.
- `record_routing_stats`: its load for the router (waiting steps) and /server_info; `check_health`.

The engine writes a video job's MP4 in this replica's own folder; its bytes go back with the result, and
the ingress writes the file it serves (remote_job.py). Images always come back as bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve

from diffserve.deploy.lora_log import LoraLog, plan_catch_up
from diffserve.deploy.messages import FinishedVideo, Placed, ReplicaFailure
from diffserve.logging_setup import LEVELS
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient, EngineState
from diffserve.server.lora_client import LoraOpError
from diffserve.server.metrics import ServerMetrics

logger = logging.getLogger("diffserve.server")

#: How often the constructor checks whether the engine is ready.
READY_POLL_S = 0.1


@dataclass
class JobLoad:
    """One job in flight: its denoising steps in all and those done (what `waiting_steps` sums)."""

    total: int
    done: int = 0


def log_to_stderr(level: str) -> None:
    """diffserve's log lines in this Ray worker's log (Ray keeps the root logger for itself)."""
    log = logging.getLogger("diffserve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
    log.setLevel(getattr(logging, level.upper()) if level in LEVELS else logging.INFO)


class EngineReplica:
    """One model's engine in one Ray Serve replica (module docstring)."""

    async def __init__(self, server_args: ServerArgs) -> None:
        log_to_stderr(server_args.log_level)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.workdir = Path(tempfile.mkdtemp(prefix="diffserve-replica-"))
        engine_args = dataclasses.replace(server_args.engine_args, output_path=str(self.workdir))
        self.args = dataclasses.replace(server_args, engine_args=engine_args)
        self.failure: str | None = None
        self.jobs: dict[str, JobLoad] = {}
        self.lora_version = 0
        self._lora_lock = asyncio.Lock()
        self.client = EngineClient(self.args, ServerMetrics(), self._on_fatal)
        await self.client.start()
        while not self.client.ready:
            if self.client.state == EngineState.FAILED:
                await self.client.stop()
                raise RuntimeError(
                    f"the engine of {self.args.model_id} cannot start: {self.client.state_detail}"
                )
            await asyncio.sleep(READY_POLL_S)
        logger.info("Replica %s of %s ready on node %s", self.replica_id, self.args.model_id, self.node_id)

    def _on_fatal(self, code: int, message: str) -> None:
        self.failure = message
        logger.error("Replica %s: the engine failed for good: %s", self.replica_id, message)

    def check_health(self) -> None:
        """Ray Serve's health check: an engine that failed for good takes the replica with it."""
        if self.failure is not None:
            raise RuntimeError(f"the engine failed and will not be restarted: {self.failure}")

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _check_target(self, replica_id: str | None) -> None:
        if replica_id is not None and replica_id != self.replica_id:
            raise RuntimeError(f"a call for replica {replica_id} reached replica {self.replica_id}")

    # -- jobs --------------------------------------------------------------------------------------
    def _local(self, job: msg.GenerateJob) -> msg.GenerateJob:
        """The job as this replica's engine runs it: a video is written in this replica's folder."""
        if job.video_path is None:
            return job
        return dataclasses.replace(job, video_path=str(self.workdir / "videos" / Path(job.video_path).name))

    def _on_event(self, load: JobLoad, events: asyncio.Queue, job: msg.GenerateJob, message: Any) -> None:
        """The engine's message about a job in flight: progress counts its waiting steps here, and is
        passed on only for a video job (its record shows it; an image route has no use for it, and every
        message streamed to the ingress costs a round of Ray's)."""
        if isinstance(message, msg.JobProgress):
            load.total = message.total if message.phase == "denoising" else load.total
            load.done = message.step if message.phase == "denoising" else load.total
            if job.video_path is None:
                return
        events.put_nowait(message)

    async def submit(self, job: msg.GenerateJob, loras: LoraLog | None = None) -> AsyncIterator[Any]:
        """Run `job`, streaming its messages (module docstring)."""
        yield Placed(self.replica_id, self.node_id)
        rid, events = job.request_id, asyncio.Queue()
        load = self.jobs[rid] = JobLoad(total=int(job.params.num_inference_steps or 0))
        try:
            try:
                if loras is not None:
                    await self._catch_up(loras)
                local = self._local(job)
                accepted, outcome = await self.client.submit(
                    local, lambda m: self._on_event(load, events, job, m)
                )
            except Exception as exc:
                yield ReplicaFailure.of(exc)
                return
            load.total = load.total or int(accepted.params.num_inference_steps or 0)
            yield accepted
            async for item in self._follow(events, outcome, local):
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            if self.client.cancel(rid):
                logger.info("Request %s: its caller went away; cancelling it", rid)
            raise
        finally:
            self.jobs.pop(rid, None)

    async def _follow(
        self, events: asyncio.Queue, outcome: asyncio.Future, job: msg.GenerateJob
    ) -> AsyncIterator[Any]:
        """The job's messages until its outcome, then the outcome."""
        while not outcome.done():
            get = asyncio.ensure_future(events.get())
            try:
                await asyncio.wait({get, outcome}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not get.done():
                    get.cancel()
            if get.done() and not get.cancelled():
                yield get.result()
        while not events.empty():
            yield events.get_nowait()
        error = outcome.exception()
        if error is not None:
            yield ReplicaFailure.of(error)
            return
        result: msg.JobFinished = outcome.result()
        if job.video_path is None or result.handoff is not None:  # no video file: images, or a hand-off
            yield result
            return
        path = Path(job.video_path)
        data = await asyncio.to_thread(path.read_bytes)
        path.unlink(missing_ok=True)
        yield FinishedVideo(result, data)

    async def cancel(self, request_id: str, *, replica_id: str) -> bool:
        """Cancel a job in flight here (the engine answers it JobCancelled); False: not in flight."""
        self._check_target(replica_id)
        return self.client.cancel(request_id)

    # -- LoRA admin ops ----------------------------------------------------------------------------
    async def _catch_up(self, log: LoraLog) -> None:
        """Make this engine serve the adapters of `log` (lora_log.py), once per version."""
        async with self._lora_lock:
            if self.lora_version >= log.version:
                return
            undo, missing = plan_catch_up(log, self.client.loras.changes)
            for change in [*undo, *missing]:
                try:
                    if isinstance(change, msg.LoadLora):
                        await self.client.load_lora(change.name, change.path, change.strict)
                    else:
                        await self.client.unload_lora(change.name)
                except LoraOpError as exc:
                    if not (isinstance(change, msg.UnloadLora) and exc.status == 404):
                        logger.error(
                            "Replica %s: LoRA %r not restored: %s", self.replica_id, change.name, exc
                        )
            self.lora_version = log.version

    async def load_lora(self, name: str, path: str, strict: bool, *, replica_id: str) -> Any:
        self._check_target(replica_id)
        try:
            return await self.client.load_lora(name, path, strict)
        except Exception as exc:
            return ReplicaFailure.of(exc)

    async def unload_lora(self, name: str, *, replica_id: str) -> Any:
        self._check_target(replica_id)
        try:
            return await self.client.unload_lora(name)
        except Exception as exc:
            return ReplicaFailure.of(exc)

    async def list_loras(self, loras: LoraLog | None = None, *, replica_id: str | None = None) -> Any:
        self._check_target(replica_id)
        try:
            if loras is not None:
                await self._catch_up(loras)
            return await self.client.list_loras()
        except Exception as exc:
            return ReplicaFailure.of(exc)

    # -- state -------------------------------------------------------------------------------------
    async def info(self, *, replica_id: str | None = None) -> dict[str, Any]:
        """The engine's report (EngineReady's info, as /server_info shows it) and its probe size."""
        self._check_target(replica_id)
        c = self.client
        return {"engine_info": c.engine_info, "probe_size": c.probe_size, "incarnation": c.incarnation}

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's load and state, for the router and /server_info (router.py)."""
        c = self.client
        return {
            "state": c.state.value,
            "detail": c.state_detail,
            "waiting": c.num_waiting,
            "running": c.num_running,
            "completed": c.completed,
            "waiting_steps": sum(max(0, job.total - job.done) for job in list(self.jobs.values())),
            "restarts": c.restarts,
            "incarnation": c.incarnation,
            "engine_pid": c.engine_pid,
            "replica_pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_id": self.node_id,
            "lora_version": self.lora_version,
        }
