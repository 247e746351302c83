"""Per-step timings without a host sync per step.

Timing a denoising step with `perf_counter` around it is only honest on an asynchronous device if the
host first waits for the step's work (`synchronize()`), and that wait stalls the host once per step:
the device then idles while the host prepares the next step. Instead, a platform puts a *mark* in its
work queue at each step boundary (a timing event on accelerators, `perf_counter` on the CPU, whose ops
run synchronously), and the seconds between two marks are read once the device has passed the later
one: `StepTimer.stop` collects the steps already finished without waiting, `StepTimer.flush` waits for
the rest once, at the end of a request. A step's time is the device's wall time between its two marks,
so it includes any time the device waited for the host, as the synchronized timing did.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol


class StepMark(ABC):
    """A point in a device's work queue."""

    @abstractmethod
    def reached(self) -> bool:
        """True once the device has done everything queued before the mark (never waits)."""

    @abstractmethod
    def seconds_since(self, start: StepMark) -> float:
        """Seconds from `start` (an earlier mark of the same platform) to this mark; waits until the
        device reaches this mark."""


class HostMark(StepMark):
    """`perf_counter` when the mark is made: exact for a device whose work is done when its ops return
    (the CPU), or after the caller synchronized."""

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def reached(self) -> bool:
        return True

    def seconds_since(self, start: StepMark) -> float:
        if not isinstance(start, HostMark):
            raise TypeError(f"a HostMark cannot be timed against a {type(start).__name__}")
        return self.time - start.time


class EventMark(StepMark):
    """A timing event recorded on the current stream of a torch accelerator runtime (`torch.cuda`,
    `torch.xpu`, `torch.mps`, ...: any module with a CUDA-like `Event(enable_timing=True)`)."""

    def __init__(self, runtime: Any) -> None:
        self.event = runtime.Event(enable_timing=True)
        self.event.record()

    def reached(self) -> bool:
        return bool(self.event.query())

    def seconds_since(self, start: StepMark) -> float:
        if not isinstance(start, EventMark):
            raise TypeError(f"an EventMark cannot be timed against a {type(start).__name__}")
        self.event.synchronize()
        return start.event.elapsed_time(self.event) / 1000.0  # elapsed_time is in milliseconds


class MarkSource(Protocol):
    def step_mark(self) -> StepMark: ...


@dataclass
class _Lap:
    start: StepMark
    end: StepMark
    #: The lists this lap's seconds are appended to (each request of the step's batch has its own).
    into: tuple[list[float], ...]

    def resolve(self) -> None:
        seconds = self.end.seconds_since(self.start)
        for times in self.into:
            times.append(seconds)


class StepTimer:
    """Appends each step's seconds to lists of step times (a request's `step_times`), in step order.

    Usage, per step: `start = timer.start()`, the step, `timer.stop(start, req.step_times, ...)`; after
    the last step of a request, `timer.flush()` before its step times are read. On the CPU every step's
    time is appended by `stop` itself; on an accelerator it lags until the device has finished the step.
    """

    def __init__(self, platform: MarkSource) -> None:
        self.platform = platform
        self._pending: deque[_Lap] = deque()

    def start(self) -> StepMark:
        return self.platform.step_mark()

    def stop(self, start: StepMark, *into: list[float]) -> None:
        """Close the step begun at `start`; its seconds go to every list of `into` once known."""
        self._pending.append(_Lap(start, self.platform.step_mark(), into))
        self.collect()

    def collect(self) -> None:
        """Append the times of the steps the device has finished, without waiting for the others."""
        while self._pending and self._pending[0].end.reached():
            self._pending.popleft().resolve()

    def flush(self) -> None:
        """Append every pending step's time, waiting for the device to finish them (one wait)."""
        while self._pending:
            self._pending.popleft().resolve()

    @property
    def pending(self) -> int:
        """Steps stopped whose time is not appended yet."""
        return len(self._pending)
