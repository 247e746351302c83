"""What an `EngineReplica` sends the ingress besides the engine's own messages (server/protocol.py).

A job's stream (`EngineReplica.submit`) yields `Placed` first (which replica took it), then the engine's
JobAccepted, JobStarted, JobPreview and a video job's JobProgress as they come, and ends with
JobFinished (a video job's MP4 travelling along as `FinishedVideo`) or a `ReplicaFailure`. Errors travel as data, not as
raised exceptions: the engine client's errors carry fields (status, param, whether the job had started)
that Ray's exception wrapping would not keep, and `ReplicaFailure.error()` gives the ingress the very
exception the single server's routes answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.server import protocol as msg
from diffserve.server.engine_client import (
    EngineDiedError,
    EngineUnavailableError,
    JobCancelledError,
    JobFailedError,
    JobRejectedError,
    QueueFullError,
)
from diffserve.server.lora_client import LoraOpError


@dataclass(frozen=True)
class Placed:
    """The replica a job's stream runs on (Ray Serve's replica id) and its Ray node."""

    replica_id: str
    node_id: str


@dataclass(frozen=True)
class FinishedVideo:
    """A video job's result: the engine's JobFinished, and the MP4's bytes (written on the replica's node,
    kept by the ingress, which serves the downloads)."""

    result: msg.JobFinished
    data: bytes


@dataclass(frozen=True)
class ReplicaFailure:
    """An engine client error as data: its kind and fields (`error()` rebuilds the exception)."""

    kind: str  # died, cancelled, unavailable, queue_full, rejected, failed, lora
    message: str
    code: str | None = None
    status: int = 500
    param: str | None = None
    started: bool = False
    user_error: bool = False
    at_step: int | None = None

    @classmethod
    def of(cls, exc: BaseException) -> ReplicaFailure:
        """`exc`, raised by the replica's engine client, as data."""
        message = str(exc)
        if isinstance(exc, EngineDiedError):
            return cls("died", message, exc.code, 503, started=exc.started)
        if isinstance(exc, JobCancelledError):
            return cls("cancelled", message, exc.code, 503, at_step=exc.at_step)
        if isinstance(exc, EngineUnavailableError):
            return cls("unavailable", message, exc.code, 503)
        if isinstance(exc, QueueFullError):
            return cls("queue_full", message, status=429)
        if isinstance(exc, JobRejectedError):
            return cls("rejected", message, status=exc.status, param=exc.param)
        if isinstance(exc, JobFailedError):
            return cls("failed", message, param=exc.param, user_error=exc.user_error)
        if isinstance(exc, LoraOpError):
            return cls("lora", message, exc.code, exc.status, exc.param)
        return cls("failed", f"{type(exc).__name__}: {exc}")

    def error(self) -> Exception:
        """The engine client's exception this stands for, as the routes expect it."""
        if self.kind == "died":
            return EngineDiedError(self.message, started=self.started)
        if self.kind == "cancelled":
            return JobCancelledError(self.at_step)
        if self.kind == "unavailable":
            return EngineUnavailableError(self.message, self.code or "engine_unavailable")
        if self.kind == "queue_full":
            return QueueFullError(self.message)
        if self.kind == "rejected":
            return JobRejectedError(self.message, self.param, self.status)
        if self.kind == "lora":
            return LoraOpError(self.message, self.status, self.param, self.code)
        return JobFailedError(self.message, self.user_error, self.param)
