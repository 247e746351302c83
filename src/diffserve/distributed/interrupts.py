"""Ctrl-C across ranks: rank 0 takes it between two ops, never inside one.

A terminal's Ctrl-C sends SIGINT to every process of its foreground group: rank 0 and the worker ranks
it spawned. The workers ignore it (`worker.worker_main`): rank 0 decides, and tells them to stop with
`STOP` on the control channel. Rank 0 holds the interrupt while an op runs (`hold_interrupts`): an op
interrupted half-way would leave the workers inside a collective that rank 0 never finishes, and
rank 0's `STOP` would then meet a broken group; the workers died or were terminated, and gloo printed
"Connection closed by peer ... GLHF!" on the user's terminal. Held, the interrupt is raised as soon as
the op is over (a denoising step: a second at most on a small model, tens of seconds on a large one on
one GPU); a second Ctrl-C meanwhile interrupts at once, as the user insists.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

logger = logging.getLogger("diffserve.distributed")


@contextlib.contextmanager
def ignore_interrupts() -> Iterator[None]:
    """SIGINT ignored while the block runs (on the main thread; elsewhere nothing changes): the worker
    processes spawned in it start with SIGINT ignored, so Python never turns a Ctrl-C into a
    KeyboardInterrupt there, even before `worker_main` runs. A Ctrl-C in the block is lost (the few
    milliseconds of a spawn)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def hold_interrupts() -> Iterator[None]:
    """Hold SIGINT until the block ends, then deliver it to the handler that was there (Python's raises
    KeyboardInterrupt). Only where Python code takes SIGINT on this thread: on the main thread, with a
    Python handler (not ignored, as in the server's engine process, which the front end stops with a
    message). Blocks nest: an inner one delivers to the outer one, which holds it in turn."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL, or a handler not installed from Python
        yield
        return
    received = 0  # SIGINTs while held: the first waits for the block's end, a second is delivered now

    def hold(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        if received == 1:
            logger.warning("Interrupted: stopping once the ranks finish their current step (again: at once)")
        else:
            previous(signum, frame)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received == 1:
            previous(signal.SIGINT, None)
