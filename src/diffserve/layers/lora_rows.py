"""Which rows of the batch a model is running use which LoRA adapters, at what scale.

One DiT forward serves several requests, each with its own adapter set (or none). Before the forward
the engine enters `lora_rows_scope(LoraRows...)`; every `LoraLinear` (layers/lora_linear.py) reads the
scope to add, per adapter, its low-rank term to the rows that use it. Outside any scope, or in a scope
with no adapter, a `LoraLinear` is its base Linear: the base path stays untouched for rows without LoRA.

The row assignment is kept on the host (built from the requests, no device reads), so narrowing it to
the rows a step cache recomputes (`narrowed`) costs nothing on the device; the row index an adapter
with scattered rows needs is made once per scope and device, on first use.

A scope with `num_rows=None` applies its adapters to every row of any batch: the phases that run one
request alone (text encoding, a request's context embedding) use `LoraRows.uniform`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AppliedLora:
    """One adapter a request applies: the registry's id for it (`runtime/lora_registry.py`), its name
    (for logs and errors) and the request's scale."""

    adapter_id: int
    name: str
    scale: float


@dataclass(frozen=True)
class AdapterRows:
    """The rows of the batch that use adapter `adapter_id`, each with its scale. `rows` None: every row,
    all at `scales[0]`."""

    adapter_id: int
    rows: tuple[int, ...] | None
    scales: tuple[float, ...]

    def __post_init__(self) -> None:
        expected = 1 if self.rows is None else len(self.rows)
        if len(self.scales) != expected:
            raise ValueError(f"adapter {self.adapter_id}: {len(self.scales)} scales for {expected} rows")

    def runs(self) -> tuple[tuple[int, int, float], ...]:
        """The rows as maximal runs [lo, hi) of consecutive rows at one scale (computed once)."""
        cached = self.__dict__.get("_runs")
        if cached is None:
            assert self.rows is not None
            cached = _runs(list(zip(self.rows, self.scales, strict=True)))
            object.__setattr__(self, "_runs", cached)
        return cached


@dataclass(eq=False)
class LoraRows:
    """The adapters of one batch (`num_rows` rows; None: any batch, every row), in adapter-id order, so
    that a row with several adapters sums their terms in the same order in any batch."""

    num_rows: int | None
    uses: tuple[AdapterRows, ...]
    _gathered: dict[tuple[int, torch.device], tuple[torch.Tensor, tuple[tuple[int, int, float], ...]]] = (
        field(default_factory=dict, repr=False)
    )
    _row_adapters: tuple[tuple[AppliedLora, ...], ...] | None = field(default=None, repr=False)

    @classmethod
    def uniform(cls, loras: Sequence[AppliedLora]) -> LoraRows:
        """Every row of any batch applies `loras` (one request running alone)."""
        ordered = sorted(loras, key=lambda lora: lora.adapter_id)
        return cls(None, tuple(AdapterRows(lora.adapter_id, None, (lora.scale,)) for lora in ordered))

    @classmethod
    def for_rows(cls, row_loras: Sequence[Sequence[AppliedLora]]) -> LoraRows:
        """One entry per batch row: the adapters that row applies (empty: none)."""
        by_adapter: dict[int, tuple[list[int], list[float]]] = {}
        for row, loras in enumerate(row_loras):
            for lora in loras:
                rows, scales = by_adapter.setdefault(lora.adapter_id, ([], []))
                rows.append(row)
                scales.append(lora.scale)
        return cls(
            len(row_loras),
            tuple(_adapter_rows(i, *by_adapter[i], len(row_loras)) for i in sorted(by_adapter)),
        )

    @property
    def active(self) -> bool:
        return bool(self.uses)

    def narrowed(self, bounds: Sequence[tuple[int, int]]) -> LoraRows:
        """The assignment for the batch made of rows [lo, hi) of each of `bounds`, in order (what a step
        cache recomputes when some requests reuse their residual)."""
        if self.num_rows is None:
            return self
        return self.picked([row for lo, hi in bounds for row in range(lo, hi)])

    def picked(self, rows: Sequence[int]) -> LoraRows:
        """The assignment for a batch whose row i is row `rows[i]` of this one (a row may come back many
        times): a mixture-of-experts layer's tokens gathered for one expert, each one row of the expert's
        batch, carry the adapters of the batch row they came from."""
        if self.num_rows is None:
            return self
        row_loras = self.row_adapters()
        return LoraRows.for_rows([row_loras[row] for row in rows])

    def row_adapters(self) -> tuple[tuple[AppliedLora, ...], ...]:
        """Per batch row, the adapters it applies (adapter-id order); a batch of `num_rows` rows. Made once
        per scope: a mixture-of-experts layer picks rows from it once per expert."""
        if self.num_rows is None:
            raise ValueError("a LoRA assignment for any batch has no rows to list")
        if self._row_adapters is None:
            row_loras: list[list[AppliedLora]] = [[] for _ in range(self.num_rows)]
            for use in self.uses:
                rows = range(self.num_rows) if use.rows is None else use.rows
                scales = use.scales * self.num_rows if use.rows is None else use.scales
                for row, scale in zip(rows, scales, strict=True):
                    row_loras[row].append(AppliedLora(use.adapter_id, "", scale))
            self._row_adapters = tuple(tuple(loras) for loras in row_loras)
        return self._row_adapters

    def gathered_rows(
        self, use: AdapterRows, device: torch.device
    ) -> tuple[torch.Tensor, tuple[tuple[int, int, float], ...]]:
        """`use`'s rows ordered by scale, as a long index on `device`, and the runs (lo, hi, scale) of
        that gathered order that share a scale; made once per scope and device."""
        key = (use.adapter_id, device)
        found = self._gathered.get(key)
        if found is None:
            assert use.rows is not None
            order = sorted(zip(use.rows, use.scales, strict=True), key=lambda pair: (pair[1], pair[0]))
            index = torch.tensor([row for row, _ in order], dtype=torch.long).to(device, non_blocking=True)
            groups = _runs([(position, scale) for position, (_, scale) in enumerate(order)])
            found = self._gathered[key] = (index, groups)
        return found


def _runs(rows: list[tuple[int, float]]) -> tuple[tuple[int, int, float], ...]:
    """(row, scale) pairs, rows ascending, as runs (lo, hi, scale) of consecutive rows at one scale."""
    runs: list[tuple[int, int, float]] = []
    for row, scale in rows:
        if runs and runs[-1][1] == row and runs[-1][2] == scale:
            runs[-1] = (runs[-1][0], row + 1, scale)
        else:
            runs.append((row, row + 1, scale))
    return tuple(runs)


def _adapter_rows(adapter_id: int, rows: list[int], scales: list[float], num_rows: int) -> AdapterRows:
    """Every row at one scale collapses to `rows=None` (one matmul over the whole batch, no gather)."""
    if len(rows) == num_rows and len(set(scales)) == 1:
        return AdapterRows(adapter_id, None, (scales[0],))
    return AdapterRows(adapter_id, tuple(rows), tuple(scales))


_current: ContextVar[LoraRows | None] = ContextVar("diffserve_lora_rows", default=None)


def current_lora_rows() -> LoraRows | None:
    """The innermost scope's assignment (None outside every scope)."""
    return _current.get()


@contextmanager
def lora_rows_scope(rows: LoraRows | None) -> Iterator[LoraRows | None]:
    """Run the enclosed model calls with `rows` (None: no adapter applies, whatever an outer scope says)."""
    token = _current.set(rows)
    try:
        yield rows
    finally:
        _current.reset(token)


@contextmanager
def narrowed_lora_rows(bounds: Sequence[tuple[int, int]]) -> Iterator[None]:
    """Within the current scope, run on only the rows of `bounds` (see `LoraRows.narrowed`)."""
    rows = _current.get()
    if rows is None or not rows.active:
        yield
        return
    with lora_rows_scope(rows.narrowed(bounds)):
        yield


def request_lora_scope(loras: Sequence[AppliedLora]) -> AbstractContextManager[LoraRows | None]:
    """The scope of a model call over one request's rows alone (its context embedding, once per
    request): every row applies the request's adapters; none, the base weights."""
    return lora_rows_scope(LoraRows.uniform(loras) if loras else None)
