"""`LoraLinear`: a Linear that adds, to the rows of the batch that use them, the low-rank terms of the
LoRA adapters registered on it, unmerged, so requests with different adapters share one forward.

    y = W x + b + sum over the row's adapters of  scale * scaling * up @ (down @ x)

(PEFT's order, with the multiply by `scaling * scale` and the add fused into the `up` matmul.)

Per adapter the work is one matmul by `down` over the rows that use it and one `addmm_` by `up` per
output piece straight into the output (segment-style, as punica and S-LoRA batch adapters for LLMs):
rows without an adapter cost nothing, and a batch without any runs the base Linear alone.

An adapter may cover parts of the output only: a fused projection (FLUX's `to_qkv`, or all adaLN
projections in one `adaln_modulation`) is one Linear whose output is its parts side by side, and a
LoRA trained on `to_k` lands on `to_k`'s rows of it. Each `LoraPiece` is one such part: its output
range, its rows of the adapter's rank, its `up` and its `scaling`.

Under `torch.compile` the adapter work is one opaque op (`diffserve::lora_linear`): the compiled
graph holds the layer's weight, bias and a CPU key tensor, never the adapters, so loading, unloading
or switching adapters never recompiles. Inside `--compile`'s scoped calls a batch without LoRA rows is
resolved at trace time (`layers/trace_scope.py`, guarded): its graph calls the base Linear, which
inductor fuses like any other, and batches with LoRA rows get the graph with the op.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.fused_linear import FusedLinear
from diffserve.layers.lora_rows import AdapterRows, LoraRows, current_lora_rows
from diffserve.layers.trace_scope import traced_lora_rows


@dataclass(frozen=True)
class LoraPiece:
    """One output range [out_start, out_stop) of the layer, fed by ranks [rank_start, rank_stop) of the
    adapter's stacked `down`, through `up` (out_stop - out_start, rank_stop - rank_start)."""

    out_start: int
    out_stop: int
    rank_start: int
    rank_stop: int
    up: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class LayerAdapter:
    """One adapter on one layer: `down` (sum of its pieces' ranks, in_features) and its pieces."""

    down: torch.Tensor
    pieces: tuple[LoraPiece, ...]

    @property
    def num_bytes(self) -> int:
        tensors = [self.down, *(piece.up for piece in self.pieces)]
        return sum(t.numel() * t.element_size() for t in tensors)


#: Up to this many row runs per adapter are updated slice by slice; more are gathered first.
_MAX_SLICED_RUNS = 4

_layer_ids = itertools.count()
_layers: weakref.WeakValueDictionary[int, LoraLinear] = weakref.WeakValueDictionary()


class LoraLinear(nn.Linear):
    """A Linear (sharing the wrapped layer's weight and bias: no copy, same state-dict names) plus the
    adapters registered on it by id. `part_names`/`part_sizes` carry a fused layer's parts over."""

    def __init__(self, base: nn.Linear) -> None:
        if not isinstance(base, nn.Linear) or isinstance(base, LoraLinear):
            raise TypeError(f"LoraLinear wraps a plain nn.Linear, got {type(base).__name__}")
        if type(base) not in (nn.Linear, FusedLinear):
            raise TypeError(
                f"LoRA on a {type(base).__name__} (a tensor-parallel shard) is not supported: run LoRA "
                "adapters with --tp-size 1"
            )
        with torch.device("meta"):
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight = base.weight
        self.bias = base.bias
        fused = isinstance(base, FusedLinear)
        self.part_names: tuple[str, ...] = base.part_names if fused else ()
        self.part_sizes: tuple[int, ...] = base.part_sizes if fused else ()
        self.adapters: dict[int, LayerAdapter] = {}
        layer_id = next(_layer_ids)
        _layers[layer_id] = self
        # On the CPU always: the compiled op reads it on the host to find this layer (no device sync).
        self.register_buffer("lora_key", torch.tensor(layer_id, dtype=torch.long), persistent=False)
        self._layer_id = layer_id

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """Keep `lora_key` on the CPU when the module moves (`.to(device)`)."""
        key = self.lora_key
        result = super()._apply(fn, recurse)
        self.lora_key = key
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if traced_lora_rows() is False:  # resolved at trace time: no row of this batch has LoRA
                return F.linear(x, self.weight, self.bias)
            return torch.ops.diffserve.lora_linear(x, self.weight, self.bias, self.lora_key)
        return self.forward_eager(x)

    def forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_window(x, 0, self.out_features)

    def forward_rows(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """`self(x)[..., rows]` computing only those output rows, adapters included (eager only: under
        torch.compile call the layer itself)."""
        start, stop, step = rows.indices(self.out_features)
        if step != 1:
            raise ValueError(f"forward_rows takes a contiguous slice, got step {step}")
        return self._forward_window(x, start, stop)

    def _forward_window(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Output rows [start, stop) of the layer: the base Linear's, plus the adapters' terms."""
        whole = (start, stop) == (0, self.out_features)
        weight = self.weight if whole else self.weight[start:stop]
        bias = self.bias if whole or self.bias is None else self.bias[start:stop]
        y = F.linear(x, weight, bias)
        rows = current_lora_rows()
        if rows is None or not self.adapters:
            return y
        uses = [use for use in rows.uses if use.adapter_id in self.adapters]
        if not uses:
            return y
        if rows.num_rows is not None and x.shape[0] != rows.num_rows:
            raise RuntimeError(
                f"LoRA rows cover a batch of {rows.num_rows}, this layer runs {x.shape[0]} rows: the caller "
                "must enter a LoRA scope for the batch it runs"
            )
        for use in uses:
            self._add_adapter(y, x, self.adapters[use.adapter_id], use, rows, start)
        return y

    @staticmethod
    def _add_adapter(
        y: torch.Tensor, x: torch.Tensor, adapter: LayerAdapter, use: AdapterRows, rows: LoraRows, start: int
    ) -> None:
        """y += this adapter's terms on the rows that use it, in place; y holds the layer's output rows
        from `start` on.

        Each run of consecutive rows at one scale is one `down` matmul and, per piece, one `addmm_`
        into `y`'s slice (no temporaries the size of the output). Rows scattered over many runs are
        gathered (grouped by scale), updated the same way and copied back, so a row gets the same
        arithmetic whatever else shares its batch."""
        if adapter.down.dtype != y.dtype:
            raise RuntimeError(f"LoRA weights are {adapter.down.dtype}, the layer computes in {y.dtype}")
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.view(-1, y.shape[-1])
        if use.rows is None:
            _add_run(flat_y, flat_x, adapter, use.scales[0], start)
            return
        per_row = flat_x.shape[0] // x.shape[0]
        runs = use.runs()
        if len(runs) <= _MAX_SLICED_RUNS:
            _add_runs(flat_y, flat_x, adapter, runs, per_row, start)
            return
        index, groups = rows.gathered_rows(use, x.device)
        gathered_y = y.index_select(0, index)
        gathered_x = x.index_select(0, index).reshape(-1, x.shape[-1])
        _add_runs(gathered_y.view(-1, y.shape[-1]), gathered_x, adapter, groups, per_row, start)
        y.index_copy_(0, index, gathered_y)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, adapters={sorted(self.adapters)}"


def _add_runs(
    y: torch.Tensor,
    x: torch.Tensor,
    adapter: LayerAdapter,
    runs: tuple[tuple[int, int, float], ...],
    per_row: int,
    start: int,
) -> None:
    """`_add_run` on each run (lo, hi, scale) of batch rows, where a batch row is `per_row` rows of the
    flattened y and x."""
    for lo, hi, scale in runs:
        _add_run(y[lo * per_row : hi * per_row], x[lo * per_row : hi * per_row], adapter, scale, start)


def _add_run(y: torch.Tensor, x: torch.Tensor, adapter: LayerAdapter, scale: float, start: int) -> None:
    """y += scale * scaling * up @ (down @ x) for each piece, in place, where y (rows, n) holds the
    layer's output rows [start, start + n) and x is (rows, in). Pieces outside that window cost nothing."""
    stop = start + y.shape[1]
    pieces = [p for p in adapter.pieces if p.out_start < stop and p.out_stop > start]
    if not pieces:
        return
    hidden = x.to(adapter.down.dtype) @ adapter.down.t()
    for piece in pieces:
        lo, hi = max(piece.out_start, start), min(piece.out_stop, stop)
        up = piece.up[lo - piece.out_start : hi - piece.out_start]
        y[:, lo - start : hi - start].addmm_(
            hidden[:, piece.rank_start : piece.rank_stop], up.t(), alpha=piece.scaling * scale
        )


@torch.library.custom_op("diffserve::lora_linear", mutates_args=())
def _lora_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor
) -> torch.Tensor:
    """The compiled graph's view of `LoraLinear.forward`: the layer found by its CPU key, run eagerly."""
    layer = _layers.get(int(key))
    if layer is None:
        raise RuntimeError(f"LoRA layer {int(key)} no longer exists")
    return layer.forward_eager(x)


@_lora_linear_op.register_fake
def _lora_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
