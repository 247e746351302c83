"""Joint attention of the MMDiTs: image and text keep their own projections and QK-norms (Diffusers'
names) and attend as one sequence, whose order is part of the numbers: [text; image] with RoPE for
FLUX and Qwen-Image (`RotaryJointAttention`), [image; text] for SD3 (`models/dits/sd3.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from diffserve.layers.attention import attention
from diffserve.layers.attention_weights import AttentionWeights, QKNormFactory
from diffserve.layers.rotary import RopeTables, RotaryEmbedding
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
    shard_linear,
)

Heads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _normed(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class JointAttention(AttentionWeights):
    """The weights of a joint attention and the per-stream projection to heads: the image stream's
    `AttentionWeights` plus the text stream's `add_*_proj`, `norm_added_*` and `to_add_out`. `qk_norm`
    builds the per-head norms of q and k (None: none); without `context_out` the text supplies keys and
    values only."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        qk_norm: QKNormFactory | None,
        context_out: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, num_heads, head_dim, qk_norm, bias=bias, out_bias=bias)
        inner = num_heads * head_dim
        self.add_q_proj = nn.Linear(dim, inner, bias=bias)
        self.add_k_proj = nn.Linear(dim, inner, bias=bias)
        self.add_v_proj = nn.Linear(dim, inner, bias=bias)
        self.norm_added_q = qk_norm() if qk_norm is not None else None
        self.norm_added_k = qk_norm() if qk_norm is not None else None
        self.to_add_out = nn.Linear(inner, dim, bias=bias) if context_out else None

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads of both streams: q/k/v column-parallel, the outputs row-parallel (a block
        without a text output has no `to_add_out`). The per-head QK-norms stay whole."""
        super().shard_for_tensor_parallel(tp)
        for name in ("add_q_proj", "add_k_proj", "add_v_proj"):
            shard_linear(self, name, ColumnParallelLinear, tp)
        if self.to_add_out is not None:
            shard_linear(self, "to_add_out", RowParallelLinear, tp)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (-1, self.head_dim))

    def project_image(self, x: torch.Tensor) -> Heads:
        return self._split(self.to_q(x)), self._split(self.to_k(x)), self._split(self.to_v(x))

    def project_text(self, ctx: torch.Tensor) -> Heads:
        return (
            self._split(self.add_q_proj(ctx)),
            self._split(self.add_k_proj(ctx)),
            self._split(self.add_v_proj(ctx)),
        )

    def image_heads(self, x: torch.Tensor) -> Heads:
        q, k, v = self.project_image(x)
        return _normed(self.norm_q, q), _normed(self.norm_k, k), v

    def text_heads(self, ctx: torch.Tensor) -> Heads:
        q, k, v = self.project_text(ctx)
        return _normed(self.norm_added_q, q), _normed(self.norm_added_k, k), v


#: The attention a joint-attention layer runs over its [text; image] q, k, v (and key mask).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class RotaryJointAttention(JointAttention):
    """Joint attention over [text; image] with RoPE on q and k (FLUX, Qwen-Image); a model whose tables
    have another layout overrides `rotate` (Qwen-Image's per-sample tables), and a model that splits its
    sequence over ranks sets `attend` to its sequence-parallel attention."""

    attend: AttentionFn = staticmethod(attention)

    def __init__(
        self, dim: int, num_heads: int, head_dim: int, qk_norm: QKNormFactory, bias: bool = True
    ) -> None:
        super().__init__(dim, num_heads, head_dim, qk_norm, bias=bias)
        self.rope = RotaryEmbedding()

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(q, k, *rope)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None = None,
        text_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(image output, text output). `attn_mask` is a key mask over [text; image] (None: all keys);
        with `text_out=False` the text's output projection is skipped and None returned in its place."""
        q, k, v = self.image_heads(x)
        cq, ck, cv = self.text_heads(ctx)
        q, k = self.rotate(torch.cat([cq, q], dim=1), torch.cat([ck, k], dim=1), rope)
        out = self.attend(q, k, torch.cat([cv, v], dim=1), attn_mask).flatten(2)
        ctx_out, x_out = out.split([ctx.shape[1], x.shape[1]], dim=1)
        # Contiguous, as in Diffusers: CPU half-precision matmuls round differently on strided views.
        x_out = self.to_out[0](x_out.contiguous())
        return x_out, self.to_add_out(ctx_out.contiguous()) if text_out else None
