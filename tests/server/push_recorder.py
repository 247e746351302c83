"""`PushRecorder`: stands in for an engine client's PUSH socket to its engine process in tests that drive
the real `EngineClient` without an engine. A plain module (not conftest.py) so tests import it by name."""

from __future__ import annotations

import pickle
from collections.abc import Callable

from diffserve.server import protocol as msg


class PushRecorder:
    """Keeps every message the front end sends; `on_job` (optional) sees each GenerateJob as it is sent."""

    def __init__(self, on_job: Callable[[msg.GenerateJob], None] | None = None) -> None:
        self.sent: list[object] = []
        self.on_job = on_job

    def send_pyobj(self, obj: object, flags: int = 0) -> None:
        self.sent.append(obj)
        if self.on_job is not None and isinstance(obj, msg.GenerateJob):
            self.on_job(obj)

    def send(self, data: bytes, flags: int = 0) -> None:
        """A pickled message, as the engine process reads it (`recv_pyobj`)."""
        self.send_pyobj(pickle.loads(data), flags)

    def jobs(self) -> list[msg.GenerateJob]:
        return [m for m in self.sent if isinstance(m, msg.GenerateJob)]

    def job_ids(self) -> list[str]:
        return [job.request_id for job in self.jobs()]

    def cancels(self) -> list[str]:
        return [m.request_id for m in self.sent if isinstance(m, msg.CancelJob)]
