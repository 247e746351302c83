"""One job sent from the ingress to a model's replicas and followed there (the ingress's side of
`EngineReplica.submit`).

`RemoteJob.start` sends the job (Ray Serve's router picks the replica, router.py) and returns the
engine's JobAccepted, or raises its refusal as the single server would (400, 413, 429, 503). A task then
follows the stream: the engine's JobStarted, JobProgress and JobPreview go to the job's listener as they
come, and the outcome future gets the JobFinished or the error. A replica that dies, or whose engine
dies, before the job started there is not the client's loss: the job is sent again (keeping its seed),
to the replica Ray's router picks then, at most `SEND_LIMIT` times in all; one that had started is
answered 503 `engine_died`, saying so.

Files come back as bytes and are written here, where the ingress serves them: a `response_format: "url"`
job runs as b64_json on the replica and its images are written to the ingress's output folder, as the
single server's engine writes them; a video job's MP4 is written where the job asked for it. So a link
works whichever node made the file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ray.exceptions import RayError

from diffserve.deploy.messages import FinishedVideo, Placed, ReplicaFailure
from diffserve.outputs.files import write_atomically
from diffserve.server import protocol as msg
from diffserve.server.engine_client import EngineDiedError, JobListener
from diffserve.server.image_files import image_path

logger = logging.getLogger("diffserve.server")

#: The most replicas one job is sent to (the first and those after replicas that died before it started).
SEND_LIMIT = 3
#: Engine codes of a replica that took a job while it could not run it (its report was not yet in).
_NOT_READY_CODES = ("engine_starting", "engine_restarting", "engine_busy")


class JobOwner(Protocol):
    """What a RemoteJob uses of its model's `RayEngines`."""

    output_dir: Path

    def send(self, job: msg.GenerateJob) -> Any:
        """The job's stream from a replica (a Ray Serve streaming response)."""

    def cancel_on(self, replica_id: str, request_id: str) -> None:
        """Ask replica `replica_id` to cancel the job."""


def for_replica(job: msg.GenerateJob) -> msg.GenerateJob:
    """The job as a replica runs it: images always come back as bytes (see the module docstring)."""
    return dataclasses.replace(job, response_format="b64_json") if job.response_format == "url" else job


def keep_images(result: msg.JobFinished, output_dir: Path) -> msg.JobFinished:
    """A url job's result with its images written to `output_dir` (as the engine's `_encode` names them)."""
    kept = []
    for image in result.images:
        path = image_path(output_dir, image.image_id, result.params.output_format)
        data = image.data or b""
        write_atomically(path, lambda partial, data=data: partial.write_bytes(data))
        kept.append(dataclasses.replace(image, data=None))
    return dataclasses.replace(result, images=kept)


def keep_video(finished: FinishedVideo, path: Path) -> msg.JobFinished:
    """A video job's result with its MP4 written at `path`, where the job manager serves it."""
    write_atomically(path, lambda partial: partial.write_bytes(finished.data))
    videos = [dataclasses.replace(video, path=str(path)) for video in finished.result.videos]
    return dataclasses.replace(finished.result, videos=videos)


class RemoteJob:
    """One job on the model's replicas (module docstring). `listener` gets the engine's JobStarted,
    JobProgress and JobPreview; `outcome` resolves to the JobFinished or the error."""

    def __init__(self, owner: JobOwner, job: msg.GenerateJob, listener: JobListener | None) -> None:
        self.owner, self.job, self.listener = owner, job, listener
        self.replica_id: str | None = None
        self.node_id: str | None = None
        self.started = False
        self.sends = 0
        self.accepted: msg.JobAccepted | None = None
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task | None = None
        self._stream: Any = None  # the current replica's stream
        self._on_done: list[Callable[[RemoteJob], None]] = []

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def on_done(self, callback: Callable[[RemoteJob], None]) -> None:
        self._on_done.append(callback)

    # -- sending -----------------------------------------------------------------------------------
    def _lost(self, error: BaseException | str) -> EngineDiedError:
        why = (str(error).strip().splitlines() or [type(error).__name__])[0]  # Ray's first line says it
        where = f"replica {self.replica_id} (node {self.node_id})" if self.replica_id else "its replica"
        if self.started:
            what = "while this request was running there (it had started: its work is lost)"
        else:
            what = f"before this request started; it was sent to {self.sends} replica(s)"
        return EngineDiedError(
            f"{where} was lost ({why}) {what}; Ray Serve starts a replacement", self.started
        )

    def _may_send_again(self, failure: ReplicaFailure | None) -> bool:
        """Whether the job goes to another replica: it had not started, the limit is not reached, and the
        replica failed as a replica (lost, engine died, not ready), not as the answer to this job."""
        if self.started or self.sends >= SEND_LIMIT:
            return False
        return failure is None or failure.kind == "died" or failure.code in _NOT_READY_CODES

    async def _open(self) -> tuple[Any, Any]:
        """Send the job until a replica answers it as a replica that can run it: (its stream, its first
        message after `Placed`). Raises the engine's refusal, or EngineDiedError once no replica is left
        to try (`_may_send_again`)."""
        while True:
            self.sends += 1
            stream = self._stream = self.owner.send(for_replica(self.job))
            try:
                first = await self._next(stream)
            except RayError as exc:
                if not self._may_send_again(None):
                    raise self._lost(exc) from None
                logger.warning("Request %s: %s; sending it again", self.request_id, self._lost(exc))
                continue
            if isinstance(first, ReplicaFailure):
                if not self._may_send_again(first):
                    raise first.error()
                logger.warning("Request %s: replica %s: %s; sending it again", self.request_id, self.replica_id, first.message)  # fmt: skip
                continue
            return stream, first

    async def start(self) -> msg.JobAccepted:
        """Send the job until a replica accepts it; raises the engine's refusal (or EngineDiedError)."""
        stream, first = await self._open()
        if not isinstance(first, msg.JobAccepted):
            raise RuntimeError(f"replica {self.replica_id} answered a job with {type(first).__name__}")
        self.accepted = first
        # Sent again, the job keeps the seed it was accepted with (what a video job's record shows).
        params = dataclasses.replace(self.job.params, seed=first.params.seed)
        self.job = dataclasses.replace(self.job, params=params)
        self._task = asyncio.get_running_loop().create_task(self._follow(stream))
        return first

    async def _next(self, stream: Any) -> Any:
        """The stream's first message after `Placed` (which names the replica)."""
        placed = await stream.__anext__()
        if isinstance(placed, Placed):
            self.replica_id, self.node_id = placed.replica_id, placed.node_id
            return await stream.__anext__()
        return placed

    # -- following ---------------------------------------------------------------------------------
    async def _follow(self, stream: Any) -> None:
        try:
            while True:
                try:
                    final = await self._events(stream)
                except RayError as exc:  # the replica was lost
                    if not self._may_send_again(None):
                        self._fail(self._lost(exc))
                        return
                    logger.warning("Request %s: %s; sending it again", self.request_id, self._lost(exc))
                else:
                    if not isinstance(final, ReplicaFailure):
                        self._finish(await asyncio.to_thread(self._keep, final))
                        return
                    if not self._may_send_again(final):
                        self._fail(final.error())
                        return
                    logger.warning("Request %s: replica %s: %s; sending it again", self.request_id, self.replica_id, final.message)  # fmt: skip
                stream = await self._send_again()
                if stream is None:
                    return
        except asyncio.CancelledError:
            self._fail(EngineDiedError("the server stopped following this request", started=self.started))
            raise
        except Exception as exc:
            logger.exception("Request %s: could not follow its replica", self.request_id)
            self._fail(exc)
        finally:
            for callback in self._on_done:
                callback(self)

    async def _send_again(self) -> Any:
        """The stream of the job sent to another replica, past its JobAccepted; None when that failed
        (the outcome then says why)."""
        try:
            stream, _ = await self._open()
        except Exception as exc:
            self._fail(exc)
            return None
        logger.info("Request %s: now on replica %s (node %s)", self.request_id, self.replica_id, self.node_id)
        return stream

    async def _events(self, stream: Any) -> Any:
        """Pass the job's events to its listener; the final message (a result or a failure). A stream
        that ends without one raises RayError, as a lost replica's does."""
        async for item in stream:
            if isinstance(item, (msg.JobStarted, msg.JobProgress, msg.JobPreview)):
                self.started = self.started or isinstance(item, msg.JobStarted)
                if self.listener is not None:
                    self.listener(item)
            elif isinstance(item, (msg.JobFinished, FinishedVideo, ReplicaFailure)):
                return item
        raise RayError(f"replica {self.replica_id}'s stream ended without the job's outcome")

    def _keep(self, final: msg.JobFinished | FinishedVideo) -> msg.JobFinished:
        if isinstance(final, FinishedVideo):
            return keep_video(final, Path(self.job.video_path or ""))
        if self.job.response_format == "url":
            return keep_images(final, self.owner.output_dir)
        return final

    def _finish(self, result: msg.JobFinished) -> None:
        if not self.outcome.done():
            self.outcome.set_result(result)

    def _fail(self, error: BaseException) -> None:
        if not self.outcome.done():
            self.outcome.set_exception(error)

    # -- control -----------------------------------------------------------------------------------
    def cancel(self) -> bool:
        """Ask the job's replica to cancel it (the engine answers JobCancelled); False once it is over."""
        if self.outcome.done() or self.replica_id is None:
            return False
        self.owner.cancel_on(self.replica_id, self.request_id)
        return True

    def abandon(self, error: BaseException) -> None:
        """Stop following (the server stops): the stream is dropped, which cancels the job there."""
        self.outcome.add_done_callback(lambda done: done.cancelled() or done.exception())  # maybe unread
        self._fail(error)
        if self._stream is not None:
            self._stream.cancel()
        if self._task is not None:
            self._task.cancel()
