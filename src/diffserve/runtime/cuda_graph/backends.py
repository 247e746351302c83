"""Capture backends of the breakable CUDA graphs: what records a segment of kernels and replays it.

- `CudaGraphBackend`: `torch.cuda.CUDAGraph`s sharing one memory pool, captured on a side stream, each
  segment replayed with `graph.replay()`. During a capture nothing executes (the kernels are only
  recorded), so the runner replays a call right after capturing it to get its result.
- `DryRunBackend`: for machines without CUDA (the tests, `tools/gpu/check.sh --dry-run`). It records
  what would be captured (segments, in order) and cannot replay them: the runner then recomputes each
  captured block eagerly through the same static buffers and break points, checking that the calls
  and breaks come in the captured order with the captured shapes. So everything up to the CUDA calls
  themselves runs: padding, bucketing, static input copies, the break points' replay-local metadata,
  the shared output buffers, the capture key and the miss/fallback paths.

The engine refuses `--enable-cuda-graph` where the platform has no CUDA graphs; the dry run is never a
silent stand-in for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class CaptureBackend(Protocol):
    """Records segments of device work and replays them."""

    name: str
    #: True: `capture_scope` executes the work as it records it, and `replay` cannot run a segment
    #: (the runner recomputes it eagerly). False: capture only records; replay runs the recording.
    records_only: bool

    def capture_scope(self) -> Any:
        """A context manager around one capture pass (streams, synchronisation)."""
        ...

    def begin_segment(self) -> None: ...

    def end_segment(self) -> Any:
        """The segment recorded since `begin_segment`."""
        ...

    def replay(self, segment: Any) -> None: ...


class CudaGraphBackend:
    """CUDA graphs on `device`, all sharing one memory pool (replays never overlap: one runs at a time)."""

    name = "cuda-graph"
    records_only = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self.graphs = 0

    @contextmanager
    def capture_scope(self) -> Iterator[None]:
        """Capture on a side stream (as `torch.cuda.graph` does), after the device is idle."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        assert self.stream is not None
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            if self._graph is not None:  # a capture that failed midway: end it so the stream is usable
                with suppress(RuntimeError):
                    self._graph.capture_end()
                self._graph = None
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            torch.cuda.synchronize(self.device)

    def begin_segment(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end_segment(self) -> torch.cuda.CUDAGraph:
        graph, self._graph = self._graph, None
        assert graph is not None, "end_segment without begin_segment"
        graph.capture_end()
        self.graphs += 1
        return graph

    def replay(self, segment: torch.cuda.CUDAGraph) -> None:
        segment.replay()


@dataclass(frozen=True)
class DrySegment:
    """A segment the dry run recorded: its position among the captured segments."""

    index: int


class DryRunBackend:
    """Records segments without CUDA; replays none (see the module docstring)."""

    name = "dry-run"
    records_only = True

    def __init__(self) -> None:
        self.graphs = 0
        self._open = False

    @contextmanager
    def capture_scope(self) -> Iterator[None]:
        yield
        self._open = False

    def begin_segment(self) -> None:
        assert not self._open, "nested segments"
        self._open = True

    def end_segment(self) -> DrySegment:
        assert self._open, "end_segment without begin_segment"
        self._open = False
        self.graphs += 1
        return DrySegment(self.graphs - 1)

    def replay(self, segment: DrySegment) -> None:
        raise RuntimeError("the dry-run backend replays nothing: the runner recomputes its segments eagerly")
