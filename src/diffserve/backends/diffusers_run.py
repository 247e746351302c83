"""`DiffusersRun`: one request's Diffusers pipeline call, advanced one denoising step at a time by the engine.

Why a thread: a Diffusers pipeline runs its whole loop inside `__call__`; the engine drives requests one
step at a time (progress, `on_step`, cancellation, its step-time metrics and its loop between steps). The
call runs on its own thread, and its `callback_on_step_end` hands control back after every step and waits
for the engine's next `advance` (or `finish`). Only one of the two threads runs at any moment, so the
call sees no concurrency; the engine thread stays in charge of the loop. A request cancelled (or
abandoned) while its call waits makes the callback raise `RequestCancelledError` inside the call, which
ends the thread and frees what the call held.

The first `advance` starts the call: that step's time includes the pipeline's own text encoding and
latent preparation, which a Diffusers call does not expose as separate phases.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffserve.errors import InvalidRequestError, RequestCancelledError
from diffserve.request import Req

#: How often a paused call checks whether its request was cancelled.
_CANCEL_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class StepDone:
    """The call finished denoising step `step` (1-based) of `total`."""

    step: int
    total: int


@dataclass(frozen=True)
class CallDone:
    """The call returned (decoded): `output` is the pipeline's output object."""

    output: object


@dataclass(frozen=True)
class CallFailed:
    error: BaseException


Event = StepDone | CallDone | CallFailed

#: What runs the pipeline: called on the run's thread with the step callback to pass as
#: `callback_on_step_end`; returns the pipeline's output.
PipelineCall = Callable[[Callable[..., dict[str, Any]]], object]


class DiffusersRun:
    """One request's call (see the module docstring). `advance` and `finish` run on the engine's thread."""

    def __init__(self, req: Req, call: PipelineCall, pipeline_name: str) -> None:
        self.req, self.call, self.pipeline_name = req, call, pipeline_name
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._resume: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._stopped = threading.Event()  # abandoned: the next resume check raises
        self._thread: threading.Thread | None = None
        self.steps_done = 0

    # -- the run's thread -----------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            output = self.call(self._on_step_end)
        except BaseException as exc:  # handed to the engine's thread, which raises it for this request
            self._events.put(CallFailed(exc))
        else:
            self._events.put(CallDone(output))

    def _on_step_end(
        self, pipe: object, step: int, timestep: object, tensors: dict[str, Any]
    ) -> dict[str, Any]:
        """`callback_on_step_end`: report the step, then wait for the engine (or stop on cancellation)."""
        total = getattr(pipe, "num_timesteps", None)
        self._events.put(StepDone(step + 1, int(total) if isinstance(total, int) else self.req.num_steps))
        while True:
            if self.req.cancelled or self._stopped.is_set():
                raise RequestCancelledError(f"request {self.req.request_id} cancelled at step {step + 1}")
            try:
                self._resume.get(timeout=_CANCEL_POLL_SECONDS)
                return {}  # no tensor changed
            except queue.Empty:
                continue

    # -- the engine's thread --------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def advance(self) -> StepDone | CallDone:
        """Run the call up to the end of its next denoising step (the first call starts it)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name=f"diffusers-{self.req.request_id[:8]}", daemon=True
            )
            self._thread.start()
        else:
            self._resume.put(True)
        return self._next_event()

    def finish(self) -> object:
        """Let the call run to its end (the steps it still reports are counted) and return its output."""
        self._resume.put(True)
        while True:
            event = self._next_event()
            if isinstance(event, CallDone):
                return event.output
            self._resume.put(True)

    def stop(self) -> None:
        """Abandon the call: a paused call raises at its next check and its thread ends; waits for it."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _next_event(self) -> StepDone | CallDone:
        event = self._events.get()
        if isinstance(event, CallFailed):
            error = self._request_error(event.error)
            if error is event.error:
                raise error
            raise error from event.error
        if isinstance(event, StepDone):
            self.steps_done = event.step
        return event

    def _request_error(self, error: BaseException) -> BaseException:
        """The pipeline's own argument checks (ValueError before any step ran) are the request's fault."""
        if isinstance(error, ValueError) and self.steps_done == 0:
            return InvalidRequestError(f"{self.pipeline_name} refused the request: {error}")
        return error
