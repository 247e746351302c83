"""`EmulatedGraphBackend`: CUDA-graph replay semantics on the CPU, for tests of the breakable-graph runner's
replay path (`runtime/cuda_graph/runner.py`), which the dry-run backend does not take.

A CUDA graph replays the kernels it recorded on the same memory: each kernel reads and writes the
addresses it had at capture. This backend records, between `begin_segment` and `end_segment`, every aten
op that runs (a `TorchDispatchMode`), with its argument and result tensors; `replay` runs the ops again
on those same tensor objects: an op that writes into its arguments (`copy_`, `add_`, `out=`) writes into
them again, a view of an earlier result is left alone (it sees that result's new values), and any other
op's new result is copied into the tensor it returned at capture. So a replay computes from whatever the
recorded tensors hold now, as a graph does, and a runner that forgot to refresh a static input, read a
buffer another segment had overwritten, or kept a tensor the graph does not write, gets a wrong answer
here as it would on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class RecordedOp:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    mutates: bool
    aliases: bool


@dataclass
class EmulatedSegment:
    """The ops one segment recorded, in order."""

    ops: list[RecordedOp] = field(default_factory=list)


def _storages(values: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)}


class _Recorder(TorchDispatchMode):
    def __init__(self, segment: EmulatedSegment) -> None:
        super().__init__()
        self.segment = segment

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        inputs = _storages((args, kwargs))
        mutates = bool(getattr(func._schema, "is_mutable", False))
        aliases = bool(outputs) and all(t.untyped_storage().data_ptr() in inputs for t in outputs)
        self.segment.ops.append(RecordedOp(func, args, kwargs, outputs, mutates, aliases))
        return result


class EmulatedGraphBackend:
    """Records segments as aten op lists and replays them on the recorded tensors (see the module
    docstring). Like a CUDA graph backend, it replays (`records_only` False)."""

    name = "emulated-graph"
    records_only = False

    def __init__(self) -> None:
        self.graphs = 0
        self.replays = 0
        self._segment: EmulatedSegment | None = None
        self._mode: _Recorder | None = None

    @contextmanager
    def capture_scope(self) -> Iterator[None]:
        try:
            yield
        finally:
            if self._mode is not None:  # a capture that failed midway
                self._mode.__exit__(None, None, None)
                self._mode = self._segment = None

    def begin_segment(self) -> None:
        assert self._segment is None, "nested segments"
        self._segment = EmulatedSegment()
        self._mode = _Recorder(self._segment)
        self._mode.__enter__()

    def end_segment(self) -> EmulatedSegment:
        assert self._mode is not None and self._segment is not None, "end_segment without begin_segment"
        self._mode.__exit__(None, None, None)
        segment, self._segment, self._mode = self._segment, None, None
        self.graphs += 1
        return segment

    def replay(self, segment: EmulatedSegment) -> None:
        self.replays += 1
        for op in segment.ops:
            if op.mutates:
                op.func(*op.args, **op.kwargs)
            elif op.aliases:
                continue  # a view: it sees its base's new values
            else:
                fresh = [
                    t for t in tree_flatten(op.func(*op.args, **op.kwargs))[0] if isinstance(t, torch.Tensor)
                ]
                for recorded, value in zip(op.outputs, fresh, strict=True):
                    recorded.copy_(value)
