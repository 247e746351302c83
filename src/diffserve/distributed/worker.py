"""A worker rank's process: watch the parent, join the process group, then hand over to the loop that
serves rank 0's ops (`RankSpec.serve`: the engine's, `diffserve.api.serve_rank`, injected so that this
low-level package, which the models import, never imports the engine).

The control channel, over `ParallelState.cpu_group` (gloo): rank 0 broadcasts one message
(`broadcast_object_list`: a decision, never a tensor), every rank acts on it, then every rank's status
(None, or its error's text) is gathered on rank 0 (`gather_object`). The message `STOP` ends the loop.
The ops themselves are in runtime/distributed_runner.py.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Protocol

import torch
import torch.distributed as dist

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.rendezvous import join_process_group
from diffserve.distributed.state import ParallelState, build_parallel_state
from diffserve.platforms import Platform, resolve_platform
from diffserve.process_start import forget_parent

#: The message that ends a worker's loop.
STOP = "stop"
#: How long a worker waits idle for rank 0's next op on the control group: a server may idle for days.
IDLE_CONTROL_TIMEOUT = timedelta(days=365)
#: Seconds between a worker's checks that its parent process is still there.
WATCHDOG_POLL_S = 0.5
#: Seconds a worker whose op or control message failed waits for its pipe from rank 0 to close, before it
#: reports the failure: rank 0's exit closes its sockets and the pipe together, a moment apart.
RANK0_EXIT_WAIT_S = 0.5

#: The read end of the pipe from this worker's parent (rank 0 of its node), once `watch_parent` runs.
_parent_link: Connection | None = None


class RankArgs(Protocol):
    """What starting a rank reads from the engine's settings (`EngineArgs`)."""

    device: str | None
    dist_timeout: int

    def parallel_config(self) -> ParallelConfig: ...


#: A rank's loop after joining: load the model, report ready, run ops until `STOP`.
ServeRank = Callable[[ParallelState, RankArgs, Platform], None]


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs (picklable, for 'spawn'; `serve` travels by reference)."""

    args: RankArgs
    rank: int
    local_rank: int
    world_size: int
    init_method: (
        str  # "diffserve-store://127.0.0.1:port" (one node), "tcp://host:port", or "env://" (torchrun)
    )
    num_threads: int
    serve: ServeRank
    log_level: int = logging.WARNING


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def receive_message(state: ParallelState) -> object:
    """Rank 0's next message (blocks until it broadcasts one)."""
    box: list[object] = [None]
    dist.broadcast_object_list(box, src=0, group=state.cpu_group)
    return box[0]


def send_status(state: ParallelState, status: str | None) -> None:
    dist.gather_object(status, None, dst=0, group=state.cpu_group)


def watch_parent(connection: Connection) -> None:
    """Exit this process at once when rank 0 is gone: its end of `connection` closes (EOF), or this
    process is re-parented (`os.getppid()` changes from what it is now: rank 0, or with the 'forkserver'
    start method the fork server, which exits with rank 0). A daemon thread: it never blocks an exit."""
    global _parent_link
    _parent_link = connection
    parent_pid = os.getppid()

    def watch() -> None:
        while True:
            try:
                if connection.poll(WATCHDOG_POLL_S):
                    connection.recv()  # the parent never sends: only EOF ends up here
            except (EOFError, OSError):
                os._exit(1)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def exit_if_rank0_gone(wait_s: float = RANK0_EXIT_WAIT_S) -> None:
    """Exit this worker at once, without a word, when its parent (rank 0) has exited: its pipe closes
    within `wait_s`. Called before a failed op or control message is reported: with rank 0 gone (killed
    by a second Ctrl-C, terminated while the server was still loading, crashed) the failure is only
    gloo's broken link to it ("Connection closed by peer ... GLHF!"), the worker has nobody left to
    report to, and rank 0's owner already says why it stopped. Nothing happens while rank 0 lives (nor in
    a process that no parent pipe watches: torchrun's ranks, other nodes' first ranks)."""
    if _parent_link is None:
        return
    try:
        closed = _parent_link.poll(wait_s)  # the parent never sends: readable means EOF
    except OSError:
        closed = True
    if closed:
        os._exit(1)


def worker_main(spec: RankSpec, connection: Connection | None, environ: dict[str, str]) -> None:
    """Target of a worker process (spawned, or forked: `process_start.py`), in rank 0's environment
    (`environ`). After rank 0's STOP it has left the process group and exits at once: the interpreter's
    teardown (seconds with torch loaded) outlasted rank 0's wait on a loaded machine, so a clean Ctrl-C ended in terminated ranks and gloo's "Connection closed by peer". SIGINT
    is ignored: a terminal's Ctrl-C reaches every rank, and rank 0 alone decides how they stop
    (`interrupts.hold_interrupts`). tqdm gets a thread lock: its default is a named semaphore that
    `os._exit` would leave behind (the resource tracker's "leaked semaphore" warning). A failure still
    raises (its traceback, exit code 1), unless rank 0 is gone (`exit_if_rank0_gone`)."""
    import tqdm

    forget_parent()
    os.environ.clear()  # rank 0's, as when it started this worker (a fork server's children have its own)
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tqdm.tqdm.set_lock(threading.RLock())
    if connection is not None:
        watch_parent(connection)
    try:
        run_rank(spec)
    except Exception:
        exit_if_rank0_gone()
        raise
    from multiprocessing import util

    util._run_finalizers(0)  # what the skipped teardown would run first: this process's semaphores unlinked
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(spec: RankSpec) -> None:
    """One non-scheduling rank, in this process: join the process group, serve, leave."""
    torch.set_num_threads(spec.num_threads)
    logging.basicConfig(level=spec.log_level, format=f"[rank {spec.rank}] %(asctime)s %(message)s")
    platform = resolve_platform(spec.args.device).for_rank(spec.local_rank)
    platform.bind_device()
    join_process_group(
        platform.dist_backend, spec.init_method, spec.rank, spec.world_size,
        timedelta(seconds=spec.args.dist_timeout),
    )  # fmt: skip
    try:
        state = build_parallel_state(spec.args.parallel_config(), spec.local_rank, IDLE_CONTROL_TIMEOUT)
        spec.serve(state, spec.args, platform)
    finally:
        dist.destroy_process_group()
