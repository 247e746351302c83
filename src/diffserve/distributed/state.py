"""`ParallelState`: this rank's place in the mesh [cfg, tp, ring, ulysses] and its process groups.

Global rank r sits at mesh coordinates (cfg, tp, ring, ulysses) with ulysses innermost (its all-to-alls
move the most bytes, so its ranks are the nearest: same node, adjacent devices). For each dimension the
state holds the group of ranks that differ only along it, and this rank's index in that group; plus one
gloo group over all ranks for control messages (the step decisions rank 0 broadcasts, status replies).

`parallel_scope(state)` makes the state current for model code in this thread (a `ContextVar`, like
`attention_backend_scope`); `current_parallel_state()` is None on one device, so single-device code
paths never see a process group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from diffserve.distributed.config import ParallelConfig

#: Mesh dimensions, outermost first.
MESH_DIMS = ("cfg", "tp", "ring", "ulysses")


@dataclass(frozen=True)
class GroupSlot:
    """One mesh dimension as seen from this rank: its group, its size and this rank's index in it."""

    group: dist.ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class ParallelState:
    config: ParallelConfig
    rank: int
    world_size: int
    local_rank: int
    slots: dict[str, GroupSlot]
    #: gloo group over every rank, for control messages (picklable objects, never tensors of the model).
    cpu_group: dist.ProcessGroup

    def _slot(self, dim: str) -> GroupSlot:
        return self.slots[dim]

    @property
    def is_scheduler(self) -> bool:
        """Rank 0 runs the engine (scheduler); the others follow its decisions."""
        return self.rank == 0

    @property
    def cfg_group(self) -> dist.ProcessGroup:
        return self._slot("cfg").group

    @property
    def cfg_degree(self) -> int:
        return self._slot("cfg").size

    @property
    def cfg_rank(self) -> int:
        return self._slot("cfg").rank

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._slot("tp").group

    @property
    def tp_size(self) -> int:
        return self._slot("tp").size

    @property
    def tp_rank(self) -> int:
        return self._slot("tp").rank

    @property
    def ring_group(self) -> dist.ProcessGroup:
        return self._slot("ring").group

    @property
    def ring_degree(self) -> int:
        return self._slot("ring").size

    @property
    def ring_rank(self) -> int:
        return self._slot("ring").rank

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """Sequence parallel, ring x ulysses ranks (ring-major: its rank = ring_rank x ulysses + ulysses_rank)."""
        return self._slot("sp").group

    @property
    def sp_degree(self) -> int:
        return self._slot("sp").size

    @property
    def sp_rank(self) -> int:
        return self._slot("sp").rank

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self._slot("ulysses").group

    @property
    def ulysses_degree(self) -> int:
        return self._slot("ulysses").size

    @property
    def ulysses_rank(self) -> int:
        return self._slot("ulysses").rank


def mesh_groups(config: ParallelConfig) -> dict[str, list[list[int]]]:
    """For each mesh dimension, and for "sp" (ring and ulysses together), the rank lists of its groups
    (every rank of the world in exactly one of each), each list in ascending rank order."""
    sizes = (config.cfg_degree, config.tp_size, config.ring_degree, config.ulysses_degree)
    mesh = torch.arange(config.num_gpus).reshape(sizes)
    groups = {}
    for axis, dim in enumerate(MESH_DIMS):
        moved = mesh.movedim(axis, -1).reshape(-1, sizes[axis])
        groups[dim] = [row.tolist() for row in moved]
    groups["sp"] = [row.tolist() for row in mesh.reshape(-1, config.sequence_parallel_degree)]
    return groups


def build_parallel_state(
    config: ParallelConfig, local_rank: int, control_timeout: timedelta
) -> ParallelState:
    """The state of this rank, once `torch.distributed` is initialized over `config.num_gpus` ranks.
    Collective: every rank calls it, in the same order relative to its other group creations.
    `control_timeout` bounds this rank's waits on the control group (a worker waits idle for the next op,
    so workers pass a long one; rank 0 waits only for replies)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != config.num_gpus:
        raise RuntimeError(f"the process group has {world} ranks but the parallel config {config.num_gpus}")
    slots = {}
    for dim, rank_lists in mesh_groups(config).items():
        group, _ = dist.new_subgroups_by_enumeration(rank_lists)
        members = next(ranks for ranks in rank_lists if rank in ranks)
        slots[dim] = GroupSlot(group, len(members), members.index(rank))
    cpu_group = dist.new_group(backend="gloo", timeout=control_timeout)
    return ParallelState(config, rank, world, local_rank, slots, cpu_group)


_current: ContextVar[ParallelState | None] = ContextVar("diffserve_parallel_state", default=None)


@contextmanager
def parallel_scope(state: ParallelState | None) -> Iterator[ParallelState | None]:
    """Make `state` the one model code sees in this thread/task until the block exits (scopes nest)."""
    token = _current.set(state)
    try:
        yield state
    finally:
        _current.reset(token)


def current_parallel_state() -> ParallelState | None:
    """The innermost scope's state; None on one device or outside any scope."""
    return _current.get()
