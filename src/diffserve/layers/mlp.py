"""The GELU projection of the DiTs' MLPs (FLUX, SD3, Qwen-Image, Wan), with the GELU computed in place.

A DiT MLP's hidden activation is the largest tensor of a block (tokens x 4 x width). `F.gelu` writes
it to a new buffer, and on the CPU a buffer that large comes fresh from the OS each call (glibc maps
allocations above its mmap threshold and unmaps them on free), so every output page is faulted in and
zeroed first. The linear layer's output is read by nothing but the GELU, so the GELU overwrites it:
the same ATen kernel, the same values, and no second buffer. Measured on this project's 2-core CPU,
tanh-GELU alone: 52.8 -> 25.6 ms at (2, 4400, 2048), 4.2 -> 2.3 ms at (1, 768, 2048). Under
`torch.compile` the in-place op is functionalized and fused like the out-of-place one.
"""

from __future__ import annotations

import torch
from torch import nn


def gelu_in_place(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU written over `x`, which the caller owns (a fresh matmul output nobody else reads)."""
    return torch.ops.aten.gelu_(x, approximate=approximate)


class GeluProjection(nn.Module):
    """Linear then GELU (`approximate` as in `F.gelu`); `proj` keeps Diffusers' `net.0.proj` weight name."""

    def __init__(self, dim_in: int, dim_out: int, approximate: str = "tanh") -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_in_place(self.proj(x), self.approximate)
