"""Admission off the receiver thread: the jobs the engine process has received and not yet queued.

Admitting a job (validation, the memory model's fitting search, holding its LoRA adapters) can take a
while for a large or hostile request. On the thread that receives messages it held everything behind it:
a cancel, a LoRA op, /health_generate's probe, the next job. Here each job is admitted on one of
`ADMISSION_WORKERS` threads, and keeps the arrival number it got when received (`reserve_seq`), so equal
priorities still start in arrival order. A cancel that arrives while its job is being admitted marks it;
the admitting thread then answers JobCancelled instead of queueing it (`lock` orders the two).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from diffserve.server import protocol as msg
from diffserve.server.engine_liveness import Liveness

logger = logging.getLogger("diffserve.engine")

#: Jobs admitted at once: a few slow admissions leave the others to threads of their own, and a flood of
#: jobs waits in the pool's queue, not in a thread each.
ADMISSION_WORKERS = 4


class Admissions:
    """The jobs received and not yet queued or answered, each admitted by `admit(job, seq)` on a worker
    thread. `lock`: held by `admit` around its last check (`cancelled`) and the enqueue, and by the
    receiver around a cancel, so a cancel is never lost between the two."""

    def __init__(
        self,
        admit: Callable[[msg.GenerateJob, int], None],
        liveness: Liveness,
        workers: int = ADMISSION_WORKERS,
    ) -> None:
        self._admit, self._liveness = admit, liveness
        self.lock = threading.Lock()
        self._cancelled: dict[str, bool] = {}  # request id -> cancelled while being admitted
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="admission")

    def submit(self, job: msg.GenerateJob, seq: int) -> None:
        """Admit `job` on a worker thread (returns at once); `seq`: its arrival number."""
        with self.lock:
            self._cancelled[job.request_id] = False
        self._pool.submit(self._run, job, seq)

    def cancel(self, request_id: str) -> bool:
        """Mark a job being admitted as cancelled (the caller holds `lock`); False: not being admitted."""
        if request_id not in self._cancelled:
            return False
        self._cancelled[request_id] = True
        return True

    def cancelled(self, request_id: str) -> bool:
        """Whether `request_id` was cancelled while being admitted (the caller holds `lock`)."""
        return self._cancelled.get(request_id, False)

    def shutdown(self) -> None:
        """Wait for the admissions in progress and queued (after `stop`, each answers at once)."""
        self._pool.shutdown(wait=True)

    def _run(self, job: msg.GenerateJob, seq: int) -> None:
        rid = job.request_id
        self._liveness.admission_started(rid)
        try:
            self._admit(job, seq)
        except Exception:  # `admit` answers its own errors; this is a bug in it, logged, never silent
            logger.exception("engine: admitting request %s failed", rid)
        finally:
            self._liveness.admission_ended(rid)
            with self.lock:
                self._cancelled.pop(rid, None)
