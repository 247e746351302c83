"""Run a function on `world_size` local rank processes joined in a gloo process group (tests, benchmarks).

`run_distributed(fn, world_size, *args)` starts one process per rank, each with one torch thread, joins
them in a gloo group through a loopback store this process opens (`distributed.rendezvous`), calls
`fn(rank, world_size, *args)` and returns the values by rank. An exception on any rank is re-raised
in the parent with that rank's traceback; the other ranks (likely blocked in a collective) are then
terminated. Every process is daemonic and is joined or terminated before the call returns, so none
outlives the caller.

`fn` and `args` must be picklable by reference (a module-level function); results travel by value
(standard pickle), so keep them small: scalars, or small tensors.

The ranks are forked from multiprocessing's fork server, a fresh interpreter started once per calling
process that has imported torch, transformers and diffusers (`diffserve.testing.preloaded`): no state
leaks from the caller, as with 'spawn', but a rank starts in a fraction of a second instead of importing
them again (seconds of CPU per rank, the most of a tiny test's run). A rank sees the environment the fork
server started with, not later changes to the caller's `os.environ`.

Many tests can share one run per mesh (starting rank processes costs more than tiny forwards): on the
ranks, `case_results` runs every case and keeps what each raised; in the parent, `MeshRuns` starts each
mesh's run once and hands each test its own case's values, so a case that raises fails its own test only.

`LoadOnlyRank` stands for a tensor-parallel rank in the test process itself, to build and load a model's
shards there (no process group, so no forward of a row-parallel layer).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch
import torch.distributed as dist

from diffserve.distributed.rendezvous import join_process_group, open_local_store
from diffserve.testing.preloaded import preloaded_context

T = TypeVar("T")

#: Seconds the parent waits between checks that a rank process is still alive.
_POLL_S = 0.2
#: Seconds the other ranks get to report their errors after a first one.
_ERROR_GRACE_S = 2.0


@dataclass(frozen=True)
class LoadOnlyRank:
    """A TP rank for building and loading shards in this process (no group: no forward)."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None = None


class DistributedRunError(RuntimeError):
    """A rank raised, died or timed out; the message names the rank and carries its traceback."""


def _rank_main(
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float,
    results: mp.Queue,
    fn: Callable[..., object],
    args: tuple[object, ...],
) -> None:
    """One rank: join the group, run `fn`, send ("ok", value) or ("error", traceback) to the parent."""
    torch.set_num_threads(1)
    try:
        try:
            join_process_group("gloo", init_method, rank, world_size, timedelta(seconds=timeout_s))
            message = (rank, "ok", pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - everything is reported to the parent, which re-raises
            message = (rank, "error", traceback.format_exc())
        results.put(message)  # before the group closes, so the cause is sent before the peers' errors
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(processes: list[BaseProcess]) -> None:
    """Terminate (then kill) the rank processes this module started that are still running."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def _collect(
    results: mp.Queue, processes: list[BaseProcess], deadline: float
) -> dict[int, tuple[str, object]]:
    """Messages by rank until every rank reported, one died or time ran out; raises on any error.

    After a first error the other ranks get `_ERROR_GRACE_S` to report theirs, and the exception lists
    them all by rank: the cause then shows next to the connection errors it caused on its peers."""
    collected: dict[int, tuple[str, object]] = {}
    first_error_at: float | None = None
    seen_dead: set[int] = set()
    while len(collected) < len(processes):
        if first_error_at is not None and time.monotonic() > first_error_at + _ERROR_GRACE_S:
            break
        try:
            rank, status, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            if first_error_at is None:
                seen_dead = _check_alive(processes, collected, deadline, seen_dead)
            continue
        collected[rank] = (status, payload)
        if status == "error" and first_error_at is None:
            first_error_at = time.monotonic()
    errors = [
        f"rank {rank} raised:\n{payload}"
        for rank, (status, payload) in sorted(collected.items())
        if status == "error"
    ]
    if errors:  # a rank that died outright (killed, os._exit) explains its peers' errors
        errors += [
            _exit_message(rank, process)
            for rank, process in enumerate(processes)
            if rank not in collected and process.exitcode is not None
        ]
    if errors:
        raise DistributedRunError("\n".join(errors))
    return collected


def _exit_message(rank: int, process: BaseProcess) -> str:
    return f"rank {rank} exited with code {process.exitcode} without a result"


def _check_alive(
    processes: list[BaseProcess],
    collected: dict[int, tuple[str, object]],
    deadline: float,
    seen_dead: set[int],
) -> set[int]:
    """The ranks that exited without reporting; raises DistributedRunError for one also in `seen_dead`
    (dead at the previous empty poll too, so its last message cannot still be in flight) or when time
    ran out."""
    dead = {r for r, p in enumerate(processes) if r not in collected and p.exitcode is not None}
    if stale := sorted(dead & seen_dead):
        raise DistributedRunError(_exit_message(stale[0], processes[stale[0]]))
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(processes))) - set(collected))
        raise DistributedRunError(f"ranks {missing} did not finish in time")
    return dead


def run_distributed(
    fn: Callable[..., T], world_size: int, *args: object, timeout_s: float = 120.0
) -> list[T]:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; the return values, indexed by rank.

    Raises `DistributedRunError` (with the failing rank's traceback) when a rank raises, dies, or the
    ranks do not all finish within `timeout_s`; all rank processes are stopped before returning."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    context = preloaded_context()
    results: mp.Queue = context.Queue()
    # The ranks join a store this process opens on a port the OS assigns now (no free-port race with
    # the other test workers' groups); it lives until the ranks are done.
    store, init_method = open_local_store(world_size, timedelta(seconds=timeout_s))  # noqa: F841 (kept alive)
    processes: list[BaseProcess] = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, init_method, timeout_s, results, fn, args),
            name=f"diffserve-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        collected = _collect(results, processes, time.monotonic() + timeout_s)
        for process in processes:
            process.join(timeout=30)
    finally:
        _stop(processes)
        results.close()
    return [pickle.loads(collected[rank][1]) for rank in range(world_size)]  # type: ignore[arg-type]


#: A case's result on one rank: ("ok", its value) or ("error", the traceback of what it raised).
CaseResult = tuple[str, object]


def case_results(run: Callable[[str], object], cases: Iterable[str]) -> dict[str, CaseResult]:
    """On a rank: `run(case)` for every case, by case; what one raises is kept as its traceback (for
    `MeshRuns` to raise in that case's test) and the next case runs."""
    results: dict[str, CaseResult] = {}
    for case in cases:
        try:
            results[case] = ("ok", run(case))
        except Exception:  # noqa: BLE001 - raised again in the parent, by that case's test
            results[case] = ("error", traceback.format_exc())
    return results


class MeshRuns:
    """One `run_distributed` per mesh, shared by the cases it runs: `start(mesh)` runs it (a rank function
    that returns `case_results`), once per mesh; calling it with `(case, mesh)` gives that case's values by rank, or raises
    `DistributedRunError` when the run failed or the case raised on any rank."""

    def __init__(self, start: Callable[[str], list[dict[str, CaseResult]]]) -> None:
        self._start = start
        self._runs: dict[str, list[dict[str, CaseResult]] | DistributedRunError] = {}

    def __call__(self, case: str, mesh: str) -> list[object]:
        if mesh not in self._runs:
            try:
                self._runs[mesh] = self._start(mesh)
            except DistributedRunError as error:
                self._runs[mesh] = error
        run = self._runs[mesh]
        if isinstance(run, DistributedRunError):
            raise run
        errors = [f"rank {rank} raised:\n{r[case][1]}" for rank, r in enumerate(run) if r[case][0] == "error"]
        if errors:
            raise DistributedRunError("\n".join(errors))
        return [r[case][1] for r in run]
