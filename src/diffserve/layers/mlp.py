"""The GELU projection of the DiTs' MLPs, the GELU written over the projection (a block's largest
tensor, read by nothing else). Under `torch.compile` the tanh GELU is traced in its logistic form, the
same function (0.5 (1 + tanh(u)) = sigmoid(2u)), as inductor's tanh is slow."""

from __future__ import annotations

import math

import torch
from torch import nn

_LOGISTIC_GELU_SCALE = 2.0 * math.sqrt(2.0 / math.pi)  # tanh(u) = 2 sigmoid(2u) - 1
_GELU_CUBIC = 0.044715


def gelu_in_place(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU written over `x`, which the caller owns (a fresh matmul output nobody else reads)."""
    if approximate == "tanh" and torch.compiler.is_compiling():
        return gelu_tanh_logistic(x)
    return torch.ops.aten.gelu_(x, approximate=approximate)


def gelu_tanh_logistic(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU as `x * sigmoid(2u)`, u = sqrt(2 / pi) (x + 0.044715 x^3): for compiled graphs."""
    return x * torch.sigmoid(_LOGISTIC_GELU_SCALE * (x + _GELU_CUBIC * x * x * x))


class GeluProjection(nn.Module):
    """Linear then GELU (`approximate` as in `F.gelu`); `proj` keeps Diffusers' `net.0.proj` weight name."""

    def __init__(self, dim_in: int, dim_out: int, approximate: str = "tanh") -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_in_place(self.proj(x), self.approximate)
