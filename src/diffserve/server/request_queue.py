"""The engine's request queue: FIFO, thread-safe, with cancellation of waiting and running requests.

The engine loop takes one request at a time with `pop()`. Step-level batching replaces this class
with a scheduler that hands out several requests per step; `put`, `cancel` and `finish` stay the same.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from diffserve.server.protocol import GenerateJob


@dataclass
class QueuedJob:
    job: GenerateJob
    #: Set to stop the request at its next denoising step boundary (shared with its `Req`).
    cancel_event: threading.Event = field(default_factory=threading.Event)

    @property
    def request_id(self) -> str:
        return self.job.request_id


class RequestQueue:
    def __init__(self) -> None:
        self._waiting: OrderedDict[str, QueuedJob] = OrderedDict()
        self._running: dict[str, QueuedJob] = {}
        self._cond = threading.Condition()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def put(self, job: GenerateJob) -> QueuedJob:
        queued = QueuedJob(job)
        with self._cond:
            self._waiting[job.request_id] = queued
            self._cond.notify()
        return queued

    def pop(self, timeout: float) -> QueuedJob | None:
        """The oldest waiting request, now marked running; None when none arrived within `timeout`."""
        with self._cond:
            if not self._waiting and not self._cond.wait_for(lambda: bool(self._waiting), timeout):
                return None
            _, queued = self._waiting.popitem(last=False)
            self._running[queued.request_id] = queued
            return queued

    def finish(self, request_id: str) -> None:
        with self._cond:
            self._running.pop(request_id, None)

    def cancel(self, request_id: str) -> Literal["waiting", "running"] | None:
        """Drop a waiting request, or flag a running one to stop at its next step. None: unknown/finished."""
        with self._cond:
            if self._waiting.pop(request_id, None) is not None:
                return "waiting"
            running = self._running.get(request_id)
            if running is not None:
                running.cancel_event.set()
                return "running"
            return None

    def cancel_all(self) -> list[str]:
        """Drop every waiting request (returned) and flag the running ones."""
        with self._cond:
            dropped = list(self._waiting)
            self._waiting.clear()
            for running in self._running.values():
                running.cancel_event.set()
            return dropped
