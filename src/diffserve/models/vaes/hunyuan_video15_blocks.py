"""Building blocks of HunyuanVideo-1.5's video VAE (Diffusers' `AutoencoderKLHunyuanVideo15`): the
encoder and decoder networks that `autoencoder_kl_hunyuan_video15.py` wraps.

Layout: activations are (batch, channels, frames, height, width). The network is a causal 3-D conv net
with DC-AE-style resampling: a downsampler folds each 2x2 (or 2x2x2) space-time cell into channels and
adds a parameter-free shortcut (the same fold, averaged down to the output width); an upsampler unfolds
channels back into cells, its shortcut repeats channels before (or after) the unfold. In time, the
clip's first frame is never merged or split (a video of 1 + 4k frames has 1 + k latent frames): it is
folded spatially only, and the channel count is fixed up by duplicating (down) or halving (up).

Every 3x3x3 convolution is causal in time and pads by *replicating* edge values (frames in front,
pixels on all four sides). The mid-block attention is single-head over every pixel of the clip, block-
causal in time (a pixel sees the pixels of its own and earlier frames); it is computed one query frame
at a time against the keys of the frames so far, which needs no (frames*pixels)^2 mask.

Everything is causal in time, so the decoder also runs on a clip a few latent frames at a time with a
`CausalCache` (`Decoder3D.forward(z, cache)`) and gives the very same frames: each causal conv carries
the last `k - 1` (padded) input frames of the previous chunk in place of its front padding, the attention
carries the keys and values of the earlier frames, the RMS norms are per position (nothing to carry),
and a temporal upsampler treats the first frame apart in the clip's first chunk only.

Module and parameter names follow Diffusers (`down_blocks.0.resnets.0.conv1.conv.weight`,
`mid_block.attentions.0.to_q.weight`, `norm_out.gamma`) so checkpoints load with `strict=True` into a
model built on the meta device. Inference only: no gradient checkpointing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.vaes.blocks import ResnetStage, resnet_chain
from diffserve.models.vaes.causal3d_blocks import CausalCache, ChannelRMSNorm
from diffserve.models.vaes.coder_layout import CoderLayout
from diffserve.models.vaes.tiling import decode_chunk_boundary


def _fold_cells(x: torch.Tensor, factor_t: int) -> torch.Tensor:
    """(B, C, factor_t*T, 2H, 2W) -> (B, factor_t*4*C, T, H, W), channels ordered (dt, dy, dx, c)."""
    b, c, t, h, w = x.shape
    cells = x.view(b, c, t // factor_t, factor_t, h // 2, 2, w // 2, 2).permute(0, 3, 5, 7, 1, 2, 4, 6)
    return cells.reshape(b, factor_t * 4 * c, t // factor_t, h // 2, w // 2)


def _unfold_cells(x: torch.Tensor, factor_t: int) -> torch.Tensor:
    """The inverse of `_fold_cells`: (B, factor_t*4*C, T, H, W) -> (B, C, factor_t*T, 2H, 2W)."""
    b, packed, t, h, w = x.shape
    c = packed // (factor_t * 4)
    cells = x.view(b, factor_t, 2, 2, c, t, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
    return cells.reshape(b, c, t * factor_t, h * 2, w * 2)


def _group_mean(x: torch.Tensor, channels: int) -> torch.Tensor:
    """Average consecutive groups of channels down to `channels` (the channel count must divide)."""
    b, c, t, h, w = x.shape
    return x.view(b, channels, c // channels, t, h, w).mean(dim=2)


class CausalConv3d(nn.Module):
    """3x3x3 (by default) conv, causal in time; all padding replicates edge values (`k - 1` frames in front,
    `k // 2` pixels per side), then the conv (unpadded) with `stride`. The conv is the child `conv` for
    Diffusers' key names. HunyuanVideo 1.0's VAE uses it too (with strides, and 1x1x1 shortcuts).

    With a `CausalCache` (a frame-chunked decode; temporal stride 1 only), the first chunk pads as the
    whole clip does and every later one is preceded by the last `k - 1` padded frames of the input so
    far, so each output frame sees exactly the frames it sees in one pass.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: tuple[int, int, int] = (1, 1, 1),
    ) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride)
        half = kernel_size // 2
        self.padding = (half, half, half, half, kernel_size - 1, 0)
        self.time_pad = kernel_size - 1

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        if cache is not None and self.time_pad:
            return self.conv(self._pad_continuing(x, cache))
        if any(self.padding):  # a 1x1x1 kernel pads nothing
            x = F.pad(x, self.padding, mode="replicate")
        return self.conv(x)

    def _pad_continuing(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        """`x` padded for the conv as a chunk of the clip `cache` has seen: the clip's first chunk as a
        whole clip, a later one spatially only, behind the last `time_pad` padded frames of the one before
        (kept for the next chunk; a copy, so the chunk's activations can be freed)."""
        previous = cache.get(self)
        if previous is None:
            padded = F.pad(x, self.padding, mode="replicate")
        else:
            padded = torch.cat([previous, F.pad(x, (*self.padding[:4], 0, 0), mode="replicate")], dim=2)
        cache.put(self, padded[:, :, -self.time_pad :].clone())
        return padded


def frame_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pixels: int) -> torch.Tensor:
    """Single-head attention over frame-major tokens (B, 1, frames * pixels, C), block-causal in time: the
    queries of frame t attend the keys of frames 0..t. One query frame at a time over the frames so far,
    which gives Diffusers' masked softmax without its (frames*pixels)^2 mask.

    The keys and values may start earlier than the queries (a chunk of a clip after its first: the earlier
    frames' keys and values in front): the queries are then the last frames, each attending the keys up
    to its own frame."""
    frames = q.shape[2] // pixels
    past = k.shape[2] // pixels - frames
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, i * pixels : (i + 1) * pixels],
                k[:, :, : (past + i + 1) * pixels],
                v[:, :, : (past + i + 1) * pixels],
            )
            for i in range(frames)
        ],
        dim=2,
    )


def _continued(cache: CausalCache | None, layer: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` (B, 1, n, C) behind those `cache` kept for `layer` from the clip's earlier chunks, all of
    them kept for the next chunk; `tokens` alone without a cache."""
    if cache is None:
        return tokens
    previous = cache.get(layer)
    tokens = tokens if previous is None else torch.cat([previous, tokens], dim=2)
    cache.put(layer, tokens)
    return tokens


class ResnetBlock(nn.Module):
    """(RMSNorm, SiLU, causal conv) twice, plus a 1x1x1 conv shortcut when the width changes."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = ChannelRMSNorm(in_channels, spatial_dims=3)
        self.conv1 = CausalConv3d(in_channels, out_channels)
        self.norm2 = ChannelRMSNorm(out_channels, spatial_dims=3)
        self.conv2 = CausalConv3d(out_channels, out_channels)
        self.conv_shortcut = nn.Conv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        # The norms return fresh tensors, so SiLU may overwrite them (the convs cache copies, not views).
        h = self.conv1(F.silu(self.norm1(x), inplace=True), cache)
        h = self.conv2(F.silu(self.norm2(h), inplace=True), cache)
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return h + shortcut


class AttentionBlock(nn.Module):
    """Single-head self-attention over all pixels of the clip, block-causal in time, residual.

    Query frame t attends the keys of frames 0..t (softmax scale 1/sqrt(channels)). Diffusers builds the
    full (frames*pixels)^2 additive mask; running one query frame at a time over the frames so far gives
    the same result without it. With a `CausalCache`, `x` is a chunk of the clip: the keys and values of
    the clip's earlier chunks are kept in the cache (under `to_k` and `to_v`) and attended too.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = ChannelRMSNorm(channels, spatial_dims=3)
        self.to_q = nn.Conv3d(channels, channels, 1)
        self.to_k = nn.Conv3d(channels, channels, 1)
        self.to_v = nn.Conv3d(channels, channels, 1)
        self.proj_out = nn.Conv3d(channels, channels, 1)

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.norm(x)
        # (B, C, T, H, W) -> (B, 1, T*H*W, C): one head, frame-major tokens, contiguous for the fused kernels.
        q, k, v = (
            proj(y).flatten(2).transpose(1, 2).unsqueeze(1).contiguous()
            for proj in (self.to_q, self.to_k, self.to_v)
        )
        k, v = _continued(cache, self.to_k, k), _continued(cache, self.to_v, v)
        out = frame_causal_attention(q, k, v, h * w).squeeze(1).transpose(1, 2).reshape(b, c, t, h, w)
        return self.proj_out(out) + x


class MidBlock(nn.Module):
    """resnet -> attention -> resnet at the lowest resolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels), ResnetBlock(channels, channels)])
        self.attentions = nn.ModuleList([AttentionBlock(channels)])

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x, cache)
        return self.resnets[1](x, cache)


class Downsample(nn.Module):
    """Halve H and W (and with `temporal`, the frames after the first) into `out_channels`.

    A causal conv to `out_channels / cell` channels is folded cell-wise into `out_channels` (the first
    frame, folded spatially only, is duplicated to fill them), plus the input folded the same way and
    averaged in groups down to `out_channels`.
    """

    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        cell = 8 if temporal else 4
        group, spare = divmod(cell * in_channels, out_channels)
        if out_channels % cell or spare or (temporal and group % 2):
            raise ValueError(
                f"HunyuanVideo-1.5 VAE: a {'temporal' if temporal else 'spatial'} downsampler from "
                f"{in_channels} to {out_channels} channels does not fold evenly into a {cell}-pixel cell"
            )
        self.conv = CausalConv3d(in_channels, out_channels // cell)
        self.temporal = temporal
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        out = self.out_channels
        if not self.temporal:
            return _fold_cells(h, 1) + _group_mean(_fold_cells(x, 1), out)
        first = _fold_cells(h[:, :, :1], 1)
        h = torch.cat([torch.cat([first, first], dim=1), _fold_cells(h[:, :, 1:], 2)], dim=2)
        shortcut = torch.cat(
            [_group_mean(_fold_cells(x[:, :, :1], 1), out), _group_mean(_fold_cells(x[:, :, 1:], 2), out)],
            dim=2,
        )
        return h + shortcut


class Upsample(nn.Module):
    """Double H and W (and with `temporal`, the frames after the first) into `out_channels`.

    A causal conv to `out_channels * cell` channels is unfolded into cells (the first frame, unfolded
    spatially only, keeps the first half of its channels), plus the input with each channel repeated
    and unfolded the same way. With a `CausalCache` only the clip's first chunk has that first frame:
    the frames of later chunks are all doubled.
    """

    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        cell = 8 if temporal else 4
        self.repeats, spare = divmod(cell * out_channels, in_channels)
        if spare or (temporal and (in_channels % cell or self.repeats % 2)):
            raise ValueError(
                f"HunyuanVideo-1.5 VAE: a {'temporal' if temporal else 'spatial'} upsampler from "
                f"{in_channels} to {out_channels} channels does not unfold evenly into a {cell}-pixel cell"
            )
        self.conv = CausalConv3d(in_channels, out_channels * cell)
        self.temporal = temporal
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        h = self.conv(x, cache)
        if not self.temporal:
            return _unfold_cells(h, 1) + _unfold_cells(x.repeat_interleave(self.repeats, dim=1), 1)
        if not self._first_chunk(cache):
            return _unfold_cells(h, 2) + _unfold_cells(x, 2).repeat_interleave(self.repeats, dim=1)
        h_first = _unfold_cells(h[:, :, :1], 1)[:, : self.out_channels]
        h = torch.cat([h_first, _unfold_cells(h[:, :, 1:], 2)], dim=2)
        shortcut = torch.cat(
            [
                _unfold_cells(x[:, :, :1], 1).repeat_interleave(self.repeats // 2, dim=1),
                _unfold_cells(x[:, :, 1:], 2).repeat_interleave(self.repeats, dim=1),
            ],
            dim=2,
        )
        return h + shortcut

    def _first_chunk(self, cache: CausalCache | None) -> bool:
        """Whether `x` starts the clip (no cache: the whole clip), marking the cache's clip as started."""
        if cache is None:
            return True
        first = self not in cache
        cache.put(self, None)
        return first


class DownBlock(ResnetStage):
    """`ResnetBlock`s, then an optional `Downsample` (HunyuanVideo 1.0's VAE holds its own the same way)."""

    resamplers_name = "downsamplers"


class UpBlock(ResnetStage):
    """`ResnetBlock`s, then an optional `Upsample`."""

    resamplers_name = "upsamplers"


def resampling_levels(spatial_compression_ratio: int, temporal_compression_ratio: int) -> tuple[int, int]:
    """(spatial, temporal) halvings for the ratios, which must be powers of two with temporal <= spatial."""
    for name, ratio in (
        ("spatial_compression_ratio", spatial_compression_ratio),
        ("temporal_compression_ratio", temporal_compression_ratio),
    ):
        if ratio < 1 or ratio & (ratio - 1):
            raise ValueError(f"HunyuanVideo-1.5 VAE: {name} must be a power of two, got {ratio}")
    if temporal_compression_ratio > spatial_compression_ratio:
        raise ValueError(
            f"HunyuanVideo-1.5 VAE: temporal_compression_ratio ({temporal_compression_ratio}) may not exceed "
            f"spatial_compression_ratio ({spatial_compression_ratio})"
        )
    return int(math.log2(spatial_compression_ratio)), int(math.log2(temporal_compression_ratio))


def _check_levels(block_out_channels: Sequence[int], spatial_levels: int, match_channel: bool) -> None:
    if spatial_levels > len(block_out_channels) - (1 if match_channel else 0):
        raise ValueError(
            f"HunyuanVideo-1.5 VAE: {spatial_levels} resampling levels need more than "
            f"{len(block_out_channels)} block_out_channels entries"
        )


@dataclass(frozen=True)
class HunyuanVideo15CoderLayout(CoderLayout):
    """A HunyuanVideo-1.5 VAE half's layout (`block_out_channels` in the half's own order: the decoder's is
    the encoder's reversed), the compression ratios that pick the resampling levels and whether a
    resampler changes the width to the next level's (`downsample_match_channel` for the encoder,
    `upsample_match_channel` for the decoder)."""

    spatial_compression_ratio: int
    temporal_compression_ratio: int
    match_channel: bool

    def resampling_levels(self) -> tuple[int, int]:
        """(spatial, temporal) resampling levels of the ratios, checked against `block_out_channels`."""
        levels = resampling_levels(self.spatial_compression_ratio, self.temporal_compression_ratio)
        _check_levels(self.block_out_channels, levels[0], self.match_channel)
        return levels


class Encoder3D(nn.Module):
    """Video (B, in_channels, 1 + r_t*k, r_s*H, r_s*W) -> moments (B, out_channels, 1 + k, H, W).

    Level i downsamples spatially when i < log2(r_s), also temporally from level log2(r_s / r_t) on. The
    output adds to `conv_out` the mid-block features averaged in channel groups down to `out_channels`.
    """

    def __init__(self, layout: HunyuanVideo15CoderLayout) -> None:
        super().__init__()
        spatial_levels, temporal_levels = layout.resampling_levels()
        in_channels, out_channels = layout.in_channels, layout.out_channels
        block_out_channels = layout.block_out_channels
        if block_out_channels[-1] % out_channels:
            raise ValueError(
                f"HunyuanVideo-1.5 VAE: the encoder's last width {block_out_channels[-1]} must be a multiple of "
                f"2 * latent_channels ({out_channels})"
            )
        self.spatial_compression_ratio = layout.spatial_compression_ratio
        self.temporal_compression_ratio = layout.temporal_compression_ratio
        self.out_channels = out_channels
        self.conv_in = CausalConv3d(in_channels, block_out_channels[0])
        blocks: list[DownBlock] = []
        channels = block_out_channels[0]
        for i, width in enumerate(block_out_channels):
            down_to = None
            if i < spatial_levels:
                down_to = block_out_channels[i + 1] if layout.match_channel else width
            temporal = spatial_levels - temporal_levels <= i < spatial_levels
            resnets = resnet_chain(ResnetBlock, channels, width, layout.layers_per_block)
            blocks.append(
                DownBlock(resnets, None if down_to is None else Downsample(width, down_to, temporal))
            )
            channels = width if down_to is None else down_to
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(block_out_channels[-1])
        self.norm_out = ChannelRMSNorm(block_out_channels[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(block_out_channels[-1], out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, _, t, h, w = x.shape
        rs, rt = self.spatial_compression_ratio, self.temporal_compression_ratio
        if (t - 1) % rt or h % rs or w % rs:
            raise ValueError(
                f"HunyuanVideo-1.5 VAE: cannot encode {t} frames of {h}x{w}: frames must be 1 + {rt}k and "
                f"height and width multiples of {rs}"
            )
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        shortcut = _group_mean(x, self.out_channels)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True)) + shortcut


class Decoder3D(nn.Module):
    """Latents (B, in_channels, 1 + k, H, W) -> video (B, out_channels, 1 + r_t*k, r_s*H, r_s*W).

    `block_out_channels` is the encoder's reversed. Level i upsamples (always 2x spatially) when
    i < log2(r_s) or i < log2(r_t), temporally too when i < log2(r_t). `conv_in` adds the latents with
    each channel repeated up to the first width.

    Without a cache `z` is the whole clip, each up block a decode chunk (`decode_chunk_boundary` before
    it). With a `CausalCache`, `z` is the next latent frames of the clip the cache has seen (a new cache:
    its first ones) and the output is exactly those frames of the whole clip's; the caller marks chunks.
    """

    def __init__(self, layout: HunyuanVideo15CoderLayout) -> None:
        super().__init__()
        spatial_levels, temporal_levels = layout.resampling_levels()
        in_channels, block_out_channels = layout.in_channels, layout.block_out_channels
        if block_out_channels[0] % in_channels:
            raise ValueError(
                f"HunyuanVideo-1.5 VAE: the decoder's first width {block_out_channels[0]} must be a multiple of "
                f"latent_channels ({in_channels})"
            )
        self.repeats = block_out_channels[0] // in_channels
        self.conv_in = CausalConv3d(in_channels, block_out_channels[0])
        self.mid_block = MidBlock(block_out_channels[0])
        blocks: list[UpBlock] = []
        channels = block_out_channels[0]
        for i, width in enumerate(block_out_channels):
            up_to = None
            if i < spatial_levels:  # temporal levels are a subset (temporal <= spatial ratio)
                up_to = block_out_channels[i + 1] if layout.match_channel else width
            resnets = resnet_chain(ResnetBlock, channels, width, layout.layers_per_block + 1)
            upsampler = None if up_to is None else Upsample(width, up_to, i < temporal_levels)
            blocks.append(UpBlock(resnets, upsampler))
            channels = width if up_to is None else up_to
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = ChannelRMSNorm(block_out_channels[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(block_out_channels[-1], layout.out_channels)

    def forward(self, z: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        x = self.conv_in(z, cache) + z.repeat_interleave(self.repeats, dim=1)
        x = self.mid_block(x, cache)
        for block in self.up_blocks:
            if cache is None:  # the whole clip at once: each up block is a decode chunk
                decode_chunk_boundary()
            x = block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True), cache)
