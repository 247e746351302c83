"""Starting the ranks of a multi-device engine, and stopping them.

The process that creates the `DiffGenerator` (the CLI, a script, the server's engine process) is rank 0:
its engine schedules. `start_ranks` spawns the other ranks of its node as worker processes ('spawn', or
the method `DIFFSERVE_START_METHOD` names: `process_start.py`), each on its own device (platform device
index = local rank; on the CPU every rank uses the CPU: each "gpu" is one rank process over gloo), and joins them in a process group on the platform's
backend through a store rank 0 opens on a loopback port the OS assigns (`rendezvous.py`), or through
torch's TCP rendezvous at `--dist-init-addr` on several nodes. Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set) nothing is spawned:
each torchrun process is its rank (`is_follower` tells the others apart from rank 0).

Workers never outlive their parent: each watches a pipe from it (EOF when the parent dies, however it
dies) and its parent pid (`worker.watch_parent`), and exits at once. They ignore Ctrl-C: rank 0 takes it
between two ops and stops them with "stop" (`interrupts.py`). `RankGroup.close()` (idempotent;
`DiffGenerator.close()`) stops and joins them, and an atexit hook calls it as a backstop.
A worker that dies makes rank 0 fail fast: its exit is checked before every op, a collective with a dead
gloo peer raises at once, and every wait is bounded by `--dist-timeout` otherwise.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NoReturn

import torch
import torch.distributed as dist

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.interrupts import hold_interrupts, ignore_interrupts
from diffserve.distributed.rendezvous import join_process_group, open_local_store
from diffserve.distributed.state import ParallelState, build_parallel_state
from diffserve.distributed.worker import STOP, RankArgs, RankSpec, ServeRank, run_rank, worker_main
from diffserve.platforms.base import Platform
from diffserve.process_start import process_context

logger = logging.getLogger("diffserve.distributed")

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Seconds `close` waits for the workers to exit after "stop", before terminating them.
JOIN_TIMEOUT_S = 10.0


class RankFailedError(RuntimeError):
    """Another rank failed an op, died, or did not answer in time."""


def under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_ENV)


def global_rank(config: ParallelConfig) -> int:
    """This process's rank: torchrun's RANK, else the first rank of its node."""
    return int(os.environ["RANK"]) if under_torchrun() else config.node_rank * config.ranks_per_node


def is_follower(config: ParallelConfig) -> bool:
    """Whether this process is a rank other than 0 (a torchrun rank, or node k > 0's first rank): it runs
    `run_follower`, not an engine."""
    return config.is_distributed and global_rank(config) != 0


def _init_method(config: ParallelConfig) -> str | None:
    """torch's rendezvous URL of a torchrun or multi-node launch; None for one node's own ranks (rank 0
    opens a loopback store for them: `open_local_store`)."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != config.num_gpus:
            raise RankFailedError(f"torchrun started {world} processes but --num-gpus is {config.num_gpus}")
        return "env://"
    if config.dist_init_addr is not None:
        return f"tcp://{config.dist_init_addr}"
    if config.nnodes > 1:
        raise RankFailedError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
    return None


class RankGroup:
    """Rank 0's handle on the ranks: the process group, its `ParallelState`, the local worker processes
    and the control channel (one broadcast op, then one gathered status per rank)."""

    def __init__(
        self, processes: list[tuple[BaseProcess, Connection]], store: dist.TCPStore | None = None
    ) -> None:
        self.processes = processes
        #: The loopback store rank 0 opened for one node's ranks (kept alive with the group), or None.
        self.store = store
        self.state: ParallelState | None = None
        self.closed = False
        self.failure: RankFailedError | None = None  # once set, every op fails at once with it
        atexit.register(self.close)

    def join(self, spec: RankSpec, platform: Platform) -> None:
        """Join the process group as rank 0 and build its state (blocks until every rank has joined)."""
        timeout = timedelta(seconds=spec.args.dist_timeout)
        join_process_group(
            platform.dist_backend, spec.init_method, 0, spec.world_size, timeout, store=self.store
        )
        self.state = build_parallel_state(spec.args.parallel_config(), spec.local_rank, timeout)

    def check_alive(self) -> None:
        """Raise (and remember) RankFailedError when a local worker process has exited."""
        if self.failure is not None:
            raise self.failure
        for rank, (process, _) in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                self.fail(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}")

    def fail(self, message: str, cause: BaseException | None = None) -> NoReturn:
        """The group is broken: this and every later op raise RankFailedError(message)."""
        self.failure = RankFailedError(f"{message}; this generator cannot run requests any more (restart it)")
        logger.error("%s", self.failure)
        raise self.failure from cause

    def broadcast(self, message: object) -> None:
        """Send `message` (an op) to every rank (they wait for it between ops)."""
        assert self.state is not None
        self.check_alive()
        try:
            dist.broadcast_object_list([message], src=0, group=self.state.cpu_group)
        except Exception as exc:  # a dead peer (gloo: connection closed) or a timeout
            self._channel_broke(exc)

    def gather(self, status: str | None) -> list[str | None]:
        """Every rank's status after an op, by rank (rank 0's is `status`): None, or its error's text."""
        assert self.state is not None
        statuses: list[str | None] = [None] * self.state.world_size
        try:
            with hold_interrupts():  # a Ctrl-C waits for every rank's answer (the ready exchange's too)
                dist.gather_object(status, statuses, dst=0, group=self.state.cpu_group)
        except Exception as exc:
            self._channel_broke(exc)
        return statuses

    def _channel_broke(self, exc: Exception) -> NoReturn:
        self.check_alive()  # a worker that exited is the better message
        self.fail(f"the ranks stopped answering ({type(exc).__name__}: {exc})", exc)

    def close(self) -> None:
        """Stop the workers (the "stop" op when the channel works), join them, terminate stragglers,
        leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.state is not None and self.failure is None:
            try:
                dist.broadcast_object_list([STOP], src=0, group=self.state.cpu_group)
            except Exception as exc:  # they are terminated below
                logger.warning("Could not tell the ranks to stop: %s", exc)
        for process, connection in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
            connection.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(args: RankArgs, platform: Platform, serve: ServeRank) -> RankGroup:
    """Rank 0: spawn this node's other ranks (each runs `serve`) and join the process group with them."""
    config = args.parallel_config()
    init_method, store = _init_method(config), None
    if init_method is None:
        store, init_method = open_local_store(config.num_gpus, timedelta(seconds=args.dist_timeout))
    spec = _spec(args, config, 0, 0, init_method, serve)
    group = RankGroup(_spawn_local(spec, config, first_rank=0), store)
    try:
        group.join(spec, platform)
    except BaseException:
        group.close()
        raise
    logger.info("Started %s over %s (%s)", config.describe(), platform.dist_backend, init_method)
    return group


def run_follower(args: RankArgs, serve: ServeRank) -> None:
    """A process whose rank is not 0 (torchrun, or node k > 0): spawn this node's other ranks (not under
    torchrun), then `serve` rank 0's ops as a rank in this process until it says stop."""
    config = args.parallel_config()
    init_method = _init_method(config)
    if init_method is None:
        raise RankFailedError("a follower rank needs torchrun or --dist-init-addr (node 0's address)")
    rank = global_rank(config)
    local_rank = int(os.environ["LOCAL_RANK"]) if under_torchrun() else 0
    spec = _spec(args, config, rank, local_rank, init_method, serve)
    spawned = [] if under_torchrun() else _spawn_local(spec, config, first_rank=rank)
    try:
        run_rank(spec)
    finally:
        for process, connection in spawned:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
            connection.close()


def _spec(
    args: RankArgs, config: ParallelConfig, rank: int, local_rank: int, init: str, serve: ServeRank
) -> RankSpec:
    level = logging.getLogger("diffserve").getEffectiveLevel()
    return RankSpec(
        args, rank, local_rank, config.num_gpus, init, torch.get_num_threads(), serve,
        log_level=max(level, logging.WARNING) if level > logging.DEBUG else level,  # rank 0 logs the rest
    )  # fmt: skip


def _spawn_local(
    spec: RankSpec, config: ParallelConfig, first_rank: int
) -> list[tuple[BaseProcess, Connection]]:
    """Worker processes for local ranks 1..ranks_per_node-1 of the node whose first rank is `first_rank`
    (`spec` with their ranks); each gets the read end of a pipe whose write end only this process holds
    (its watchdog)."""
    context = process_context()
    started = []
    for local_rank in range(1, config.ranks_per_node):
        rank = first_rank + local_rank
        watched, kept = context.Pipe(duplex=False)
        process = context.Process(
            target=worker_main,
            args=(replace(spec, rank=rank, local_rank=local_rank), watched, dict(os.environ)),
            name=f"diffserve-rank-{rank}",
            daemon=True,
        )
        with ignore_interrupts():  # inherited: the worker ignores Ctrl-C from its first instruction
            process.start()
        watched.close()  # the child has its copy; ours would keep the pipe open after we die
        started.append((process, kept))
    return started
