"""Building blocks of HunyuanVideo's (1.0) video VAE (Diffusers' `AutoencoderKLHunyuanVideo`): the encoder
and decoder networks that `autoencoder_kl_hunyuan_video.py` wraps.

Layout: activations are (batch, channels, frames, height, width). A causal 3-D conv net with GroupNorm
ResNet blocks: every convolution pads by *replicating* edge values, all its temporal padding in front
(output frame t sees input frames <= t). Downsamplers are stride-2 causal convs; upsamplers repeat
pixels (nearest) then convolve, the clip's first frame never doubled in time (a video of 1 + 4k frames
has 1 + k latent frames). The mid-block attention is single-head over every pixel of the clip, block-
causal in time (a pixel sees the pixels of its own and earlier frames); it is computed one query frame
at a time against the keys of the frames so far, which gives Diffusers' masked softmax without its
(frames*pixels)^2 mask.

Which levels resample (Diffusers' rule, 4x temporal compression, the only one its decoder builds): level i
of n halves (doubles) space while i < log2(spatial ratio), and time at levels n - 3 and n - 2.

Module and parameter names follow Diffusers (`down_blocks.0.resnets.0.conv1.conv.weight`,
`mid_block.attentions.0.group_norm.weight`, `up_blocks.0.upsamplers.0.conv.conv.weight`) so checkpoints
load with `strict=True` into a model built on the meta device. Inference only.

The causal convolution, the block-causal attention loop and the (resnets, resampler) levels are
HunyuanVideo 1.5's (`hunyuan_video15_blocks.py`); the GroupNorm resnets and the resamplers are its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.vaes.blocks import resnet_chain
from diffserve.models.vaes.coder_layout import CoderLayout
from diffserve.models.vaes.hunyuan_video15_blocks import (
    CausalConv3d,
    DownBlock,
    UpBlock,
    frame_causal_attention,
)

NORM_EPS = 1e-6


class ResnetBlock(nn.Module):
    """(GroupNorm, SiLU, causal conv) twice, plus a 1x1x1 causal-conv shortcut when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=NORM_EPS)
        self.conv1 = CausalConv3d(in_channels, out_channels)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=NORM_EPS)
        self.conv2 = CausalConv3d(out_channels, out_channels)
        self.conv_shortcut = (
            CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return h + shortcut


class CausalFrameAttention(nn.Module):
    """Single-head self-attention over all pixels of the clip, block-causal in time, residual; Diffusers'
    `Attention` names (`group_norm`, `to_q`, `to_k`, `to_v`, `to_out.0`), Linear projections per pixel."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=NORM_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        # (B, C, T, H, W) -> (B, T*H*W, C) tokens, frame-major.
        y = self.group_norm(x).flatten(2).transpose(1, 2)
        q, k, v = (proj(y).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out[0](frame_causal_attention(q, k, v, h * w).squeeze(1))
        return out.transpose(1, 2).reshape(b, c, t, h, w) + x


class MidBlock(nn.Module):
    """resnet -> attention (unless switched off) -> resnet at the lowest resolution."""

    def __init__(self, channels: int, groups: int, add_attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock(channels, channels, groups), ResnetBlock(channels, channels, groups)]
        )
        self.attentions = nn.ModuleList([CausalFrameAttention(channels, groups) if add_attention else None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions[0] is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Downsample(nn.Module):
    """A causal conv with stride (time, 2, 2) or (1, 2, 2) (or time only), Diffusers' `downsamplers.0`."""

    def __init__(self, channels: int, stride: tuple[int, int, int]) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, channels, 3, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest upsampling by `factor` (time, h, w) with the first frame upsampled in space only, then a
    causal conv (Diffusers' `upsamplers.0`)."""

    def __init__(self, channels: int, factor: tuple[int, int, int]) -> None:
        super().__init__()
        self.factor = factor
        self.conv = CausalConv3d(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = F.interpolate(x[:, :, 0], scale_factor=self.factor[1:], mode="nearest").unsqueeze(2)
        if x.shape[2] > 1:
            rest = F.interpolate(x[:, :, 1:].contiguous(), scale_factor=self.factor, mode="nearest")
            first = torch.cat([first, rest], dim=2)
        return self.conv(first)


def resampling(levels: int, spatial_ratio: int, temporal_ratio: int) -> list[tuple[int, int, int] | None]:
    """Per level, its (time, h, w) resampling factor, or None when it keeps the size (module docstring)."""
    if temporal_ratio != 4:
        raise ValueError(
            f"HunyuanVideo VAE: temporal_compression_ratio {temporal_ratio} is not supported (Diffusers builds 4 only)"
        )
    spatial_levels = int(math.log2(spatial_ratio))
    temporal_levels = int(math.log2(temporal_ratio))
    factors: list[tuple[int, int, int] | None] = []
    for i in range(levels):
        spatial = i < spatial_levels
        temporal = i >= levels - 1 - temporal_levels and i != levels - 1
        factors.append(
            (2 if temporal else 1, 2 if spatial else 1, 2 if spatial else 1) if spatial or temporal else None
        )
    return factors


@dataclass(frozen=True)
class HunyuanVideoCoderLayout(CoderLayout):
    """A HunyuanVideo VAE half's layout (`block_out_channels` in the encoder's order for both halves), its
    GroupNorm `groups`, the compression ratios that pick the resampling levels and whether the mid block
    attends."""

    groups: int
    spatial_ratio: int
    temporal_ratio: int
    mid_attention: bool


class Encoder3D(nn.Module):
    """Video (B, in, T, H, W) -> moments (B, 2 * latent, 1 + (T - 1) / 4, H / 8, W / 8)."""

    def __init__(self, layout: HunyuanVideoCoderLayout) -> None:
        super().__init__()
        block_out_channels, groups = layout.block_out_channels, layout.groups
        self.conv_in = CausalConv3d(layout.in_channels, block_out_channels[0])
        factors = resampling(len(block_out_channels), layout.spatial_ratio, layout.temporal_ratio)
        previous = block_out_channels[0]
        blocks = []
        for channels, factor in zip(block_out_channels, factors, strict=True):
            resnets = resnet_chain(
                partial(ResnetBlock, groups=groups), previous, channels, layout.layers_per_block
            )
            blocks.append(DownBlock(resnets, None if factor is None else Downsample(channels, factor)))
            previous = channels
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(block_out_channels[-1], groups, layout.mid_attention)
        self.conv_norm_out = nn.GroupNorm(groups, block_out_channels[-1], eps=NORM_EPS)
        self.conv_out = CausalConv3d(block_out_channels[-1], layout.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class Decoder3D(nn.Module):
    """Latents (B, latent, t, h, w) -> video (B, out, 1 + 4 (t - 1), 8h, 8w), not clamped."""

    def __init__(self, layout: HunyuanVideoCoderLayout) -> None:
        super().__init__()
        block_out_channels, groups = layout.block_out_channels, layout.groups
        reversed_channels = list(reversed(block_out_channels))
        self.conv_in = CausalConv3d(layout.in_channels, reversed_channels[0])
        self.mid_block = MidBlock(reversed_channels[0], groups, layout.mid_attention)
        factors = resampling(len(block_out_channels), layout.spatial_ratio, layout.temporal_ratio)
        previous = reversed_channels[0]
        blocks = []
        for channels, factor in zip(reversed_channels, factors, strict=True):
            resnets = resnet_chain(
                partial(ResnetBlock, groups=groups), previous, channels, layout.layers_per_block + 1
            )
            blocks.append(UpBlock(resnets, None if factor is None else Upsample(channels, factor)))
            previous = channels
        self.up_blocks = nn.ModuleList(blocks)
        self.conv_norm_out = nn.GroupNorm(groups, block_out_channels[0], eps=NORM_EPS)
        self.conv_out = CausalConv3d(block_out_channels[0], layout.out_channels)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))
