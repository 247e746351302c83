"""Per-step timings without a host sync per step: a platform marks its work queue at each step boundary
(a timing event, or `perf_counter` on the CPU), read once the device has passed them (`flush` waits)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Protocol


class StepMark(ABC):
    """A point in a device's work queue."""

    @abstractmethod
    def reached(self) -> bool:
        """True once the device has done everything queued before the mark (never waits)."""

    @abstractmethod
    def seconds_since(self, start: StepMark) -> float:
        """Seconds from `start`, an earlier mark of the same platform; waits until the device reaches this one."""


class HostMark(StepMark):
    """`perf_counter` when made: exact where ops are done when they return (the CPU), or after a sync."""

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def reached(self) -> bool:
        return True

    def seconds_since(self, start: StepMark) -> float:
        if not isinstance(start, HostMark):
            raise TypeError(f"a HostMark cannot be timed against a {type(start).__name__}")
        return self.time - start.time


class EventMark(StepMark):
    """A timing event on the current stream of a torch accelerator runtime (`torch.cuda`, `torch.mps`, ...)."""

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


class StepTimer:
    """Appends each step's seconds to lists of step times, in step order: per step `start = timer.start()`,
    the step, `timer.stop(start, req.timings.steps, ...)`; `flush()` before the times are read."""

    def __init__(self, platform: MarkSource) -> None:
        self.platform = platform
        # (start, end, the lists its seconds go to) per stopped step whose time is not appended yet.
        self._pending: deque[tuple[StepMark, StepMark, tuple[list[float], ...]]] = deque()

    def start(self) -> StepMark:
        return self.platform.step_mark()

    def stop(self, start: StepMark, *into: list[float]) -> None:
        """Close the step begun at `start`; its seconds go to every list of `into` once known."""
        self._pending.append((start, self.platform.step_mark(), into))
        self.collect()

    def collect(self) -> None:
        """Append the times of the steps the device has finished, without waiting for the others."""
        while self._pending and self._pending[0][1].reached():
            self._resolve_oldest()

    def flush(self) -> None:
        """Append every pending step's time, waiting for the device to finish them (one wait)."""
        while self._pending:
            self._resolve_oldest()

    def _resolve_oldest(self) -> None:
        start, end, into = self._pending.popleft()
        seconds = end.seconds_since(start)
        for times in into:
            times.append(seconds)

    @property
    def pending(self) -> int:
        return len(self._pending)
