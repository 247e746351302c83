"""The weights of one stream of Diffusers' `Attention`, which the DiTs' attention modules share: `to_q`,
`to_k`, `to_v` (width -> heads x head_dim), the optional QK-norms `norm_q` / `norm_k`, and the output
projection `to_out.0` (Diffusers' `to_out.1` is a dropout: no weights). Each model adds its own forward
(how it splits heads, where it applies RoPE, which attention it runs)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from diffserve.layers.attention_reuse import ReusableAttention
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
    shard_linear,
)

#: Builds one QK-norm (called once for q, once for k).
QKNormFactory = Callable[[], nn.Module]


class AttentionWeights(ReusableAttention):
    """q/k/v projections from `dim` (keys and values from `kv_dim` when given: cross-attention), QK-norms
    built by `qk_norm` (None: none) and `to_out.0` back to `dim`; `head_dim` is kept for the forward. An
    attention-level cache method may stand in for its output (`ReusableAttention`)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        qk_norm: QKNormFactory | None = None,
        *,
        kv_dim: int | None = None,
        bias: bool = True,
        out_bias: bool = True,
    ) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.is_cross_attention = kv_dim is not None
        kv_dim = dim if kv_dim is None else kv_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(kv_dim, inner, bias=bias)
        self.to_v = nn.Linear(kv_dim, inner, bias=bias)
        self.norm_q = qk_norm() if qk_norm is not None else None
        self.norm_k = qk_norm() if qk_norm is not None else None
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=out_bias)])

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads: q/k/v column-parallel (whole heads), `to_out` row-parallel. Per-head QK-norms
        stay whole; a forward that splits heads by `head_dim` runs on the local heads unchanged."""
        for name in ("to_q", "to_k", "to_v"):
            shard_linear(self, name, ColumnParallelLinear, tp)
        shard_linear(self, "to_out.0", RowParallelLinear, tp)
