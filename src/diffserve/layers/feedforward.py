"""The GELU MLP of the DiTs: Diffusers' `FeedForward`, `net` = [GELU projection, dropout (an
`nn.Identity`, keeping the `net.2` weight name), Linear]."""

from __future__ import annotations

import torch
from torch import nn

from diffserve.layers.mlp import GeluProjection
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
    shard_linear,
)


class FeedForward(nn.Module):
    """dim -> inner_dim (default 4 * dim) -> dim_out (default dim), a GELU (`approximate` as in `F.gelu`)
    in between."""

    def __init__(
        self, dim: int, inner_dim: int | None = None, dim_out: int | None = None, approximate: str = "tanh"
    ) -> None:
        super().__init__()
        inner_dim = inner_dim or 4 * dim
        self.net = nn.ModuleList(
            [GeluProjection(dim, inner_dim, approximate), nn.Identity(), nn.Linear(inner_dim, dim_out or dim)]
        )

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's slice of the hidden features: the GELU projection column-parallel (the GELU is
        elementwise, so it runs on the local slice), the output Linear row-parallel."""
        shard_linear(self, "net.0.proj", ColumnParallelLinear, tp)
        shard_linear(self, "net.2", RowParallelLinear, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))
