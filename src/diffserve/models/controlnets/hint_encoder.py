"""The pixel-space control encoder of XLabs' FLUX.1 ControlNets (Diffusers' `ControlNetConditioningEmbedding`
as `FluxControlNetModel.input_hint_block`), native, with Diffusers' parameter names.

XLabs' ControlNets read the control image itself, not its VAE latents: a small conv stack (3x3 convs with
SiLU, every second one with stride 2) brings the (rows, 3, H, W) image in [-1, 1] to the latent grid, and a
last conv (zero-initialised in training) to `conditioning_embedding_channels`, which the ControlNet then
packs into patches like the latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ControlHintEncoder(nn.Module):
    """`conv_in`, then per step between `block_out_channels` a 3x3 conv and a 3x3 stride-2 conv (`blocks`),
    each followed by SiLU, then `conv_out`: the image downsampled by 2 ** (len(block_out_channels) - 1)."""

    def __init__(
        self,
        conditioning_embedding_channels: int,
        conditioning_channels: int = 3,
        block_out_channels: tuple[int, ...] = (16, 16, 16, 16),
    ) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(conditioning_channels, block_out_channels[0], kernel_size=3, padding=1)
        self.blocks = nn.ModuleList()
        for channels_in, channels_out in zip(block_out_channels[:-1], block_out_channels[1:], strict=True):
            self.blocks.append(nn.Conv2d(channels_in, channels_in, kernel_size=3, padding=1))
            self.blocks.append(nn.Conv2d(channels_in, channels_out, kernel_size=3, padding=1, stride=2))
        self.conv_out = nn.Conv2d(
            block_out_channels[-1], conditioning_embedding_channels, kernel_size=3, padding=1
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.conv_in(image))
        for block in self.blocks:
            x = F.silu(block(x))
        return self.conv_out(x)
