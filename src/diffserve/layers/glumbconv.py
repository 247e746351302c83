"""GLUMBConv: the gated inverted-bottleneck convolution of SANA (its DiT's Mix-FFN) and of DC-AE (the
EfficientViT blocks' feed-forward), with Diffusers' parameter names.

    h = SiLU(conv1x1(x))                      (batch, 2 * hidden, H, W)
    h, gate = depthwise_conv3x3(h) split in two along channels
    out = conv1x1(h * SiLU(gate)) [-> norm] [+ x]

The depthwise 3x3 convolution is what gives the linear-attention DiT its local mixing (SANA uses no
positional embedding at 1024 px). Diffusers keeps this class in the SANA transformer and imports it
into DC-AE; here it sits below both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GLUMBConv(nn.Module):
    """Mix-FFN on (batch, channels, H, W) maps.

    `norm` (DC-AE only) is applied to the output over channels, before the optional residual add; its
    weights load as `norm.*`. The hidden width is `int(expand_ratio * in_channels)`, as Diffusers rounds it.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        expand_ratio: float = 4.0,
        norm: nn.Module | None = None,
        residual_connection: bool = False,
    ) -> None:
        super().__init__()
        hidden = int(expand_ratio * in_channels)
        self.residual_connection = residual_connection
        self.conv_inverted = nn.Conv2d(in_channels, 2 * hidden, kernel_size=1)
        self.conv_depth = nn.Conv2d(2 * hidden, 2 * hidden, kernel_size=3, padding=1, groups=2 * hidden)
        self.conv_point = nn.Conv2d(hidden, out_channels, kernel_size=1, bias=False)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.conv_inverted(x), inplace=True)
        h, gate = self.conv_depth(h).chunk(2, dim=1)
        h = self.conv_point(h * F.silu(gate))
        if self.norm is not None:
            h = self.norm(h)
        return h + x if self.residual_connection else h
