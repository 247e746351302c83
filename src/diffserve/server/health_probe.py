"""`/health_generate`'s generation: a real short generation at a small size, through the queue (one step,
or the family's `PipelineFacts.probe_steps`: the engine completes the probe as the family's probes are).

The route needs no API key, so the probe is rate-limited here: one generation in flight at a time, shared
by concurrent callers, and its result reused for a while (status_routes.py serves it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from diffserve.configs.sampling_params import SamplingParams
from diffserve.server.disconnects import run_unless_disconnected
from diffserve.server.engine_client import JobFailedError, JobRejectedError
from diffserve.server.errors import error_body
from diffserve.server.protocol import GenerateJob
from diffserve.server.replicas import Engines

logger = logging.getLogger("diffserve.server")


def health_check_params(size: int) -> SamplingParams:
    """The probe's request as this front end sends it: `size` pixels square, one step. The engine completes
    it for its family (`runtime.calibration.health_probe_params`: input images, frames, at least its
    probe steps, its probe settings)."""
    return SamplingParams(prompt="health check", height=size, width=size, num_inference_steps=1)


@dataclass(frozen=True)
class ProbeResult:
    """One /health_generate generation's answer, and when and on which engine it ran."""

    status: int
    body: dict[str, Any]
    finished_at: float  # time.monotonic()
    incarnation: int  # a restarted engine is probed afresh


class HealthProbe:
    """/health_generate's generation, rate-limited (the route is open): one in flight, shared by
    concurrent callers, reused for `reuse_s` s, queued like any job (429 when full), cancelled once no
    caller waits for it."""

    def __init__(self, engine: Engines, timeout_s: float, reuse_s: float) -> None:
        self.engine, self.timeout_s, self.reuse_s = engine, timeout_s, reuse_s
        self._task: asyncio.Task[ProbeResult] | None = None
        self._waiters = 0
        self._last: ProbeResult | None = None

    def recent(self) -> ProbeResult | None:
        last = self._last
        if last is None or not self.engine.ready or last.incarnation != self.engine.incarnation:
            return None
        return last if time.monotonic() - last.finished_at < self.reuse_s else None

    async def result(self, request: Request) -> tuple[ProbeResult, bool]:
        """The result and whether it was reused; raises ClientDisconnected, and the engine client's
        errors before queueing."""
        if (last := self.recent()) is not None:
            return last, True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(request.state.request_id))
        task = self._task
        self._waiters += 1
        try:
            return await run_unless_disconnected(request, asyncio.shield(task)), False
        finally:
            self._waiters -= 1
            if self._waiters == 0 and not task.done():
                logger.info("Cancelling the /health_generate probe: no caller is waiting for it anymore")
                task.cancel()  # engine.generate sends CancelJob
                if self._task is task:
                    self._task = None  # the next caller starts a new probe

    async def _run(self, request_id: str) -> ProbeResult:
        engine, size = self.engine, self.engine.probe_size
        params = health_check_params(size)
        job = GenerateJob(request_id, params, internal=True)
        incarnation, start = engine.incarnation, time.monotonic()
        try:
            result = await asyncio.wait_for(engine.generate(job), self.timeout_s)
        except asyncio.TimeoutError:
            message = f"the health-check generation did not finish in {self.timeout_s:g} s"
            status, body = 503, error_body(503, message, None, "health_check_timeout")
        except (JobFailedError, JobRejectedError) as exc:
            message = f"the health-check generation failed: {exc}"
            status, body = 503, error_body(503, message, None, "health_check_failed")
        else:
            seconds, engine_seconds = round(time.monotonic() - start, 4), round(result.engine_seconds, 4)
            body = {"status": "ok", "seconds": seconds, "engine_seconds": engine_seconds}
            steps = result.params.num_inference_steps  # the family's probe steps (the engine's)
            status, body = 200, {**body, "size": f"{size}x{size}", "num_inference_steps": steps}
        self._last = ProbeResult(status, body, time.monotonic(), incarnation)
        return self._last
