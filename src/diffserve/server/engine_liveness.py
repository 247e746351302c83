"""The engine process's liveness, for the front end's watchdog (`engine_client.EngineClient`).

Each thread that must keep turning stamps when its current turn began: the engine loop (one `run_once`:
a step, or a short wait when idle), the receiver (one message, or a short poll) and each admission (one
job's validation and memory fitting). The heartbeat thread sends the longest turn in progress every
`HEARTBEAT_INTERVAL_S` (`EngineHeartbeat`): near zero for an engine that is idle or stepping along, and
growing for one stuck inside a step, a message or an admission. The front end restarts the engine when
that, or the silence since the last heartbeat (a frozen process), exceeds `--engine-watchdog-seconds`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds between two heartbeats of the engine process.
HEARTBEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Stall:
    """The longest turn in progress: how long it has lasted, and what it is."""

    seconds: float
    doing: str


class Liveness:
    """When the current turn of the engine loop, of the receiver and of each admission began (any
    thread stamps; `longest` reads). `describe_loop` names the loop's turn when asked (what is running
    then: a turn that never ends is named by what it is stuck in, not by what it was about to do)."""

    def __init__(self, describe_loop: Callable[[], str], clock: Callable[[], float] = time.monotonic) -> None:
        self._describe_loop, self._clock = describe_loop, clock
        self._lock = threading.Lock()
        now = clock()
        self._loop_since = now
        self._receiver: tuple[float, str] = (now, "the receiver, starting")
        self._admissions: dict[str, float] = {}

    def loop_turn(self) -> None:
        """The engine loop starts a turn."""
        with self._lock:
            self._loop_since = self._clock()

    def receiver_turn(self, doing: str) -> None:
        """The receiver starts a turn: a poll for the next message, or handling one."""
        with self._lock:
            self._receiver = (self._clock(), doing)

    def admission_started(self, request_id: str) -> None:
        with self._lock:
            self._admissions[request_id] = self._clock()

    def admission_ended(self, request_id: str) -> None:
        with self._lock:
            self._admissions.pop(request_id, None)

    def longest(self) -> Stall:
        """The turn in progress that began first."""
        with self._lock:
            now = self._clock()
            # None names the loop's turn: described below, outside the lock (it reads the scheduler).
            turns: list[tuple[float, str | None]] = [(self._loop_since, None), self._receiver]
            turns += [(since, f"admitting request {rid}") for rid, since in self._admissions.items()]
        since, doing = min(turns, key=lambda turn: turn[0])
        return Stall(max(0.0, now - since), self._describe_loop() if doing is None else doing)
