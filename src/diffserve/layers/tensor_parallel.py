"""Tensor parallelism (Megatron style): Linear layers whose weights are split over the ranks of a TP group.

- `ColumnParallelLinear` splits the output features: each rank holds 1/T of the weight's rows (and of
  the bias) and computes its slice of the output, with no communication. Attention q/k/v split this
  way give each rank whole heads; an MLP's first projection gives each rank its slice of the hidden
  features, on which an elementwise activation runs locally.
- `RowParallelLinear` splits the input features: each rank holds 1/T of the weight's columns, multiplies
  its slice of the input (what a column-parallel layer left on it) and the partial sums are all-reduced
  over the group; the bias, replicated, is added once after the reduce.

A column layer followed by a row layer (attention's q/k/v then its output projection, an MLP's two
projections) costs one all-reduce of the layer's output per pair.

The layers are built with their shard's shapes (on the meta device, before any weight is read), and each
one says which part of the checkpoint's full tensor it holds (`shard_specs`): along the split dimension,
the rank's piece of every *segment* (a Linear whose input is the concatenation [attention; MLP], as
FLUX's single-stream `proj_out`, has two segments, and a rank holds its piece of each). The loader
(`loader/safetensors_weights.py`) reads exactly those ranges with safetensors' `get_slice`, so a rank
never reads, nor holds, the rest of a sharded tensor (`tensor_parallel_shards`).

- `ParallelRMSNorm` is an RMSNorm over a feature dimension that a column-parallel layer left split over
  the group (Wan's QK-norm normalises q and k across all heads together): each rank holds its slice of
  the weight, and the sum of squares is all-reduced so that every rank divides by the full width's RMS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from diffserve.layers.norms import RMSNorm


class TensorParallelRank(Protocol):
    """This rank's place in its tensor-parallel group (`ParallelState` is one)."""

    @property
    def tp_group(self) -> dist.ProcessGroup: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def tp_rank(self) -> int: ...


@dataclass(frozen=True)
class ShardSpec:
    """The part of a checkpoint tensor of shape `full_shape` that one rank holds: along `dim`, the
    concatenation of the index ranges `ranges` ([start, stop) each, in order)."""

    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(stop - start for start, stop in self.ranges)
        return tuple(shape)

    def indices(self) -> list[tuple[slice, ...]]:
        """One basic index per range (full slices before `dim`), as safetensors' `get_slice` takes them."""
        leading = (slice(None),) * self.dim
        return [(*leading, slice(start, stop)) for start, stop in self.ranges]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of a full tensor held in memory (tests, and checkpoints already loaded)."""
        pieces = [full[index] for index in self.indices()]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


def shard_ranges(segments: Sequence[int], tp_size: int, tp_rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, stop) ranges rank `tp_rank` of `tp_size` holds of a dimension made of `segments`
    (their lengths, in order): its equal piece of each segment. A segment that does not divide is a
    ValueError (a layer's caller checks its own unit first, e.g. attention heads, to name it)."""
    ranges, offset = [], 0
    for length in segments:
        if length % tp_size:
            raise ValueError(f"a segment of {length} features does not split over {tp_size} TP ranks")
        piece = length // tp_size
        ranges.append((offset + tp_rank * piece, offset + (tp_rank + 1) * piece))
        offset += length
    return tuple(ranges)


class ParallelLinear(nn.Linear):
    """A Linear holding one rank's shard of a full `in_features x out_features` layer, split along
    `split_dim` of its weight (0: output features, 1: input features) into each of `segments`.

    Built like `nn.Linear` (under `torch.device("meta")` it allocates nothing), with the shard's shapes;
    `full_in_features` / `full_out_features` are the checkpoint's.
    """

    split_dim: ClassVar[int]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallelRank,
        segments: Sequence[int] | None = None,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        full = (out_features, in_features)
        segments = tuple(segments) if segments is not None else (full[self.split_dim],)
        if sum(segments) != full[self.split_dim]:
            raise ValueError(
                f"segments {segments} do not add up to the split dimension {full[self.split_dim]}"
            )
        ranges = shard_ranges(segments, tp.tp_size, tp.tp_rank)
        local = full[self.split_dim] // tp.tp_size
        local_out, local_in = (local, in_features) if self.split_dim == 0 else (out_features, local)
        super().__init__(local_in, local_out, bias=bias, device=device, dtype=dtype)
        self.full_in_features, self.full_out_features = in_features, out_features
        self.tp_group, self.tp_size, self.tp_rank = tp.tp_group, tp.tp_size, tp.tp_rank
        self._weight_spec = ShardSpec(full, self.split_dim, ranges)

    @classmethod
    def replacing(
        cls, linear: nn.Linear, tp: TensorParallelRank, segments: Sequence[int] | None = None
    ) -> ParallelLinear:
        """The shard of a plain `linear` (same full sizes, bias, device and dtype: meta before loading)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"only a plain nn.Linear can be sharded, got {type(linear).__name__}")
        return cls(
            linear.in_features, linear.out_features, tp, segments,
            bias=linear.bias is not None, device=linear.weight.device, dtype=linear.weight.dtype,
        )  # fmt: skip

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> the part of the checkpoint tensor this rank holds (parameters not listed,
        such as a row-parallel bias, are held whole)."""
        return {"weight": self._weight_spec}

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, full=({self.full_in_features}, {self.full_out_features}), "
            f"tp_rank={self.tp_rank}/{self.tp_size}"
        )


class ColumnParallelLinear(ParallelLinear):
    """Output features split: this rank computes its slice of the output (no communication)."""

    split_dim = 0

    def shard_specs(self) -> dict[str, ShardSpec]:
        specs = super().shard_specs()
        if self.bias is not None:
            spec = self._weight_spec
            specs["bias"] = ShardSpec(spec.full_shape[:1], 0, spec.ranges)
        return specs


class RowParallelLinear(ParallelLinear):
    """Input features split: this rank multiplies its slice of the input, the partial sums are
    all-reduced over the TP group, then the (replicated) bias is added once."""

    split_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out if self.bias is None else out.add_(self.bias)


def shard_linear(
    owner: nn.Module,
    name: str,
    kind: type[ParallelLinear],
    tp: TensorParallelRank,
    segments: Sequence[int] | None = None,
) -> ParallelLinear:
    """Replace the plain Linear at dotted path `name` under `owner` by its `kind` shard (before loading)."""
    parent, _, leaf = name.rpartition(".")
    holder = owner.get_submodule(parent)
    sharded = kind.replacing(getattr(holder, leaf), tp, segments)
    setattr(holder, leaf, sharded)
    return sharded


class ParallelRMSNorm(nn.Module):
    """One rank's shard of an RMSNorm over `full_dim` features (weight included) whose input arrives split
    over the TP group as a column-parallel layer leaves it (this rank: its `ranges` of the features).

    The mean square must be the full width's, not this rank's slice's: the fp32 sum of squares of the
    local features is all-reduced over the group, then each rank scales its own features. The numbers
    are `F.rms_norm`'s (fp32 throughout, the weight multiplied in fp32, one rounding to the input dtype
    at the end), up to the order of the sum.
    """

    def __init__(
        self,
        full_dim: int,
        tp: TensorParallelRank,
        eps: float = 1e-6,
        segments: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        segments = tuple(segments) if segments is not None else (full_dim,)
        if sum(segments) != full_dim:
            raise ValueError(f"segments {segments} do not add up to the normalised width {full_dim}")
        ranges = shard_ranges(segments, tp.tp_size, tp.tp_rank)
        self.full_dim, self.eps = full_dim, eps
        self.tp_group, self.tp_size, self.tp_rank = tp.tp_group, tp.tp_size, tp.tp_rank
        self.weight = nn.Parameter(torch.ones(full_dim // tp.tp_size, device=device, dtype=dtype))
        self._weight_spec = ShardSpec((full_dim,), 0, ranges)

    @classmethod
    def replacing(cls, norm: RMSNorm, tp: TensorParallelRank) -> ParallelRMSNorm:
        """The shard of a `layers.norms.RMSNorm` with a weight and `F.rms_norm`'s rounding (`round_once`):
        the numerics this layer reproduces (another norm is a TypeError, not a silent change)."""
        if type(norm) is not RMSNorm or norm.weight is None or not norm.round_once:
            raise TypeError(
                "only an affine RMSNorm with round_once=True can be sharded, got "
                f"{type(norm).__name__}({getattr(norm, 'dim', '?')})"
            )
        return cls(norm.dim, tp, norm.eps, device=norm.weight.device, dtype=norm.weight.dtype)

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> the part of the checkpoint tensor this rank holds (its weight slice)."""
        return {"weight": self._weight_spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x`: (..., full_dim / T), this rank's features; returns them normalised by the full width's RMS."""
        xf = x.float()
        sum_sq = xf.square().sum(-1, keepdim=True)
        if self.tp_size > 1:
            dist.all_reduce(sum_sq, group=self.tp_group)
        scale = torch.rsqrt(sum_sq.div_(self.full_dim).add_(self.eps))
        return (xf * scale * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, full={self.full_dim}, eps={self.eps}, tp_rank={self.tp_rank}/{self.tp_size}"


def shard_rms_norm(owner: nn.Module, name: str, tp: TensorParallelRank) -> ParallelRMSNorm:
    """Replace the RMSNorm at dotted path `name` under `owner` by its `ParallelRMSNorm` shard (before loading)."""
    parent, _, leaf = name.rpartition(".")
    holder = owner.get_submodule(parent)
    sharded = ParallelRMSNorm.replacing(getattr(holder, leaf), tp)
    setattr(holder, leaf, sharded)
    return sharded


def tensor_parallel_shards(module: nn.Module) -> dict[str, ShardSpec]:
    """State-dict name -> shard, for every sharded parameter under `module` (empty: nothing is sharded)."""
    specs = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, (ParallelLinear, ParallelRMSNorm)):
            for param, spec in sub.shard_specs().items():
                specs[f"{prefix}.{param}" if prefix else param] = spec
    return specs
