"""The GELU MLP of the DiTs (FLUX, SD3, Qwen-Image and Wan blocks, Wan's image embedder).

Diffusers' `FeedForward` with a GELU activation: `net` = [GELU projection, dropout, Linear]. The
dropout slot is an `nn.Identity` (inference) so the weights keep Diffusers' `net.0.proj` and `net.2`
names. The GELU is written over the first projection's output (`GeluProjection`).
"""

from __future__ import annotations

import torch
from torch import nn

from diffserve.layers.mlp import GeluProjection

#: Diffusers' default hidden width of a FeedForward, as a multiple of its input width.
DEFAULT_MULT = 4


class FeedForward(nn.Module):
    """dim -> inner_dim -> dim_out MLP with a GELU (`approximate` as in `F.gelu`) in between.

    `inner_dim` defaults to 4 * dim and `dim_out` to dim, Diffusers' defaults.
    """

    def __init__(
        self, dim: int, inner_dim: int | None = None, dim_out: int | None = None, approximate: str = "tanh"
    ) -> None:
        super().__init__()
        inner_dim = inner_dim or DEFAULT_MULT * dim
        self.net = nn.ModuleList(
            [GeluProjection(dim, inner_dim, approximate), nn.Identity(), nn.Linear(inner_dim, dim_out or dim)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))
