"""Diffusers' `AutoencoderKLHunyuanImage`: HunyuanImage 2.1's image VAE (64 latent channels, 32x spatial
compression for the released one).

    encode: image (B, 3, 32H, 32W) in [-1, 1] -> DiagonalGaussian over (B, 64, H, W)
    decode: latents (B, 64, H, W) -> image (B, 3, 32H, 32W), roughly in [-1, 1]

The network is a 2-D conv net with DC-AE-style resampling: a downsampler folds each 2x2 pixel cell into
channels after a 3x3 conv and adds a parameter-free shortcut (the input folded the same way, averaged down
to the output width); an upsampler unfolds channels back into cells, its shortcut repeats channels before
the unfold. The encoder's head adds the mid-block output averaged down to the moments' width, the
decoder's stem adds the latents repeated up to its width. Norms are GroupNorm(32, eps 1e-6); the mid
blocks' attention is single-head over all pixels.

As in Diffusers there are no quant / post-quant convs, the decoded image is not clamped (the pipeline's
post-processing clamps) and the latent scaling (`/ scaling_factor` before decoding) is the pipeline's job:
`scaling_factor` is kept in `config`. Decode tiling (`enable_tiling`, Diffusers' parameters and defaults:
`sample_size`-pixel tiles, a quarter overlapping) cross-fades tiles with `tiling.stitch_tiles`, exactly as
Diffusers' `tiled_decode`; encode never tiles (Diffusers' tiled encode expects 5-D video input and fails on
images), so a large image is encoded whole. Module and parameter names follow Diffusers (the resnets and
resamplers of a stage are one flat `down_blocks` / `up_blocks` list), so checkpoints load with
`strict=True` into a model built on the meta device. Inference only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.attention import attention
from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.coder_layout import CoderLayout
from diffserve.models.vaes.tiling import TilingMixin, decode_chunk_boundary, per_sample, run_overlapping_tiles

NORM_EPS = 1e-6
NORM_GROUPS = 32

#: Diffusers' `AutoencoderKLHunyuanImage` config keys, with the released VAE's values as defaults.
HUNYUAN_IMAGE_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 64,
    "block_out_channels": (128, 256, 512, 512, 1024, 1024),
    "layers_per_block": 2,
    "spatial_compression_ratio": 32,
    "sample_size": 384,
    "scaling_factor": 0.75289,
    "downsample_match_channel": True,
    "upsample_match_channel": True,
}


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(NORM_GROUPS, channels, eps=NORM_EPS, affine=True)


def _fold_cells(x: torch.Tensor) -> torch.Tensor:
    """(B, C, 2H, 2W) -> (B, 4C, H, W), channels ordered (dy, dx, c)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


def _unfold_cells(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `_fold_cells`: (B, 4C, H, W) -> (B, C, 2H, 2W)."""
    b, packed, h, w = x.shape
    c = packed // 4
    return x.view(b, 2, 2, c, h, w).permute(0, 3, 4, 1, 5, 2).reshape(b, c, h * 2, w * 2)


def _group_mean(x: torch.Tensor, channels: int) -> torch.Tensor:
    """Average consecutive groups of channels down to `channels` (the channel count must divide)."""
    b, c, h, w = x.shape
    return x.view(b, channels, c // channels, h, w).mean(dim=2)


class ResnetBlock(nn.Module):
    """(GroupNorm, SiLU, 3x3 conv) twice plus the input. Diffusers' block applies its 1x1 `conv_shortcut`
    (present when the width changes) to the branch, not the input; the released layouts never change the
    width inside a resnet, and so that case is refused rather than reproduced."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if in_channels != out_channels:
            raise ValueError(
                f"a HunyuanImage VAE resnet from {in_channels} to {out_channels} channels is not supported "
                "(the *_match_channel layouts keep every resnet's width)"
            )
        self.norm1 = _group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The norms return fresh tensors, so SiLU may overwrite them.
        h = self.conv1(F.silu(self.norm1(x), inplace=True))
        h = self.conv2(F.silu(self.norm2(h), inplace=True))
        return h + x


class AttentionBlock(nn.Module):
    """Single-head self-attention over every pixel (1x1 conv projections), residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _group_norm(channels)
        self.to_q = nn.Conv2d(channels, channels, 1)
        self.to_k = nn.Conv2d(channels, channels, 1)
        self.to_v = nn.Conv2d(channels, channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)
        # (B, C, H, W) -> (B, H*W, 1 head, C)
        q, k, v = (
            conv(normed).flatten(2).transpose(1, 2).unsqueeze(2) for conv in (self.to_q, self.to_k, self.to_v)
        )
        out = attention(q, k, v).squeeze(2).transpose(1, 2).reshape(b, c, h, w)
        return self.proj(out) + x


class MidBlock(nn.Module):
    """resnet, (attention, resnet) x num_layers, at one width."""

    def __init__(self, channels: int, num_layers: int = 1) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels) for _ in range(num_layers + 1)])
        self.attentions = nn.ModuleList([AttentionBlock(channels) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attn, resnet in zip(self.attentions, self.resnets[1:], strict=True):
            x = resnet(attn(x))
        return x


class Downsample(nn.Module):
    """Halves H and W: conv to out/4 channels then a 2x2 fold, plus the folded input averaged to `out`."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if out_channels % 4:
            raise ValueError(
                f"a HunyuanImage VAE downsampler needs out_channels divisible by 4, got {out_channels}"
            )
        self.conv = nn.Conv2d(in_channels, out_channels // 4, 3, padding=1)
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fold_cells(self.conv(x)) + _group_mean(_fold_cells(x), self.out_channels)


class Upsample(nn.Module):
    """Doubles H and W: conv to 4*out channels then a 2x2 unfold, plus the input's channels repeated to
    4*out and unfolded."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels * 4, 3, padding=1)
        self.repeats = 4 * out_channels // in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x.repeat_interleave(self.repeats, dim=1)
        return _unfold_cells(self.conv(x)) + _unfold_cells(shortcut)


def _resampling_levels(block_out_channels: Sequence[int], spatial_compression_ratio: int) -> int:
    """How many stages end with a resampler: Diffusers' `i < log2(ratio) and i != last`."""
    return min(len(block_out_channels) - 1, math.ceil(math.log2(spatial_compression_ratio)))


@dataclass(frozen=True)
class HunyuanImageCoderLayout(CoderLayout):
    """A HunyuanImage VAE half's layout (`block_out_channels` in the half's own order: the decoder's is the
    encoder's reversed; the encoder's `out_channels` is its moments, twice the latent width), the spatial
    compression ratio that sets how many stages resample and whether a resampler changes the width to the
    next stage's (`downsample_match_channel` / `upsample_match_channel`)."""

    spatial_compression_ratio: int
    match_channel: bool


def _stage_blocks(
    layout: HunyuanImageCoderLayout, resnets: int, resampler: Callable[[int, int], nn.Module]
) -> list[nn.Module]:
    """A half's flat `down_blocks` / `up_blocks`: every stage's `resnets` resnets in order, the first
    `_resampling_levels` stages each followed by `resampler(width, next width)` (the stage's own width
    unless `match_channel`)."""
    widths = tuple(layout.block_out_channels)
    blocks: list[nn.Module] = []
    width = widths[0]
    levels = _resampling_levels(widths, layout.spatial_compression_ratio)
    for i, stage_width in enumerate(widths):
        for _ in range(resnets):
            blocks.append(ResnetBlock(width, stage_width))
            width = stage_width
        if i < levels:
            out = widths[i + 1] if layout.match_channel else width
            blocks.append(resampler(width, out))
            width = out
    return blocks


class Encoder2D(nn.Module):
    """Image -> moments (B, 2 * latent, H / r, W / r)."""

    def __init__(self, layout: HunyuanImageCoderLayout) -> None:
        super().__init__()
        widths = tuple(layout.block_out_channels)
        self.moments = layout.out_channels
        if widths[-1] % self.moments:
            raise ValueError(
                f"block_out_channels[-1] ({widths[-1]}) must be divisible by 2 * latent_channels ({self.moments})"
            )
        self.conv_in = nn.Conv2d(layout.in_channels, widths[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(_stage_blocks(layout, layout.layers_per_block, Downsample))
        self.mid_block = MidBlock(widths[-1])
        self.norm_out = _group_norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], self.moments, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        shortcut = _group_mean(x, self.moments)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True)) + shortcut


class Decoder2D(nn.Module):
    """Latents (B, latent, h, w) -> image (B, out, r * h, r * w)."""

    def __init__(self, layout: HunyuanImageCoderLayout) -> None:
        super().__init__()
        widths = tuple(layout.block_out_channels)
        latent_channels = layout.in_channels
        if widths[0] % latent_channels:
            raise ValueError(
                f"the decoder's first width ({widths[0]}) must be divisible by latent_channels ({latent_channels})"
            )
        self.repeats = widths[0] // latent_channels
        self.conv_in = nn.Conv2d(latent_channels, widths[0], 3, padding=1)
        self.mid_block = MidBlock(widths[0])
        self.up_blocks = nn.ModuleList(_stage_blocks(layout, layout.layers_per_block + 1, Upsample))
        self.norm_out = _group_norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], layout.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z) + z.repeat_interleave(self.repeats, dim=1)
        h = self.mid_block(h)
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h), inplace=True))


class AutoencoderKLHunyuanImage(DiffusersConfigured, TilingMixin, nn.Module):
    """HunyuanImage 2.1's image VAE with Diffusers' config keys and weight names."""

    diffusers_class_name: ClassVar[str] = "AutoencoderKLHunyuanImage"
    config_defaults = HUNYUAN_IMAGE_VAE_CONFIG_DEFAULTS

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 3,
        latent_channels: int = 64,
        block_out_channels: Sequence[int] = (128, 256, 512, 512, 1024, 1024),
        layers_per_block: int = 2,
        spatial_compression_ratio: int = 32,
        sample_size: int = 384,
        scaling_factor: float = 0.75289,
        downsample_match_channel: bool = True,
        upsample_match_channel: bool = True,
    ) -> None:
        super().__init__()
        self.config: dict[str, Any] = {
            "in_channels": in_channels,
            "out_channels": out_channels,
            "latent_channels": latent_channels,
            "block_out_channels": tuple(block_out_channels),
            "layers_per_block": layers_per_block,
            "spatial_compression_ratio": spatial_compression_ratio,
            "sample_size": sample_size,
            "scaling_factor": scaling_factor,
            "downsample_match_channel": downsample_match_channel,
            "upsample_match_channel": upsample_match_channel,
        }
        self.encoder = Encoder2D(
            HunyuanImageCoderLayout(
                in_channels,
                2 * latent_channels,
                block_out_channels,
                layers_per_block,
                spatial_compression_ratio,
                downsample_match_channel,
            )
        )
        self.decoder = Decoder2D(
            HunyuanImageCoderLayout(
                latent_channels,
                out_channels,
                tuple(reversed(block_out_channels)),
                layers_per_block,
                spatial_compression_ratio,
                upsample_match_channel,
            )
        )
        # Diffusers' tile defaults: `sample_size`-pixel tiles, a quarter of each overlapping.
        self.tile_sample_min_size = sample_size
        self.tile_latent_min_size = sample_size // spatial_compression_ratio
        self.tile_overlap_factor = 0.25

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (32 for the released VAE)."""
        return self.config["spatial_compression_ratio"]

    def enable_tiling(
        self, tile_sample_min_size: int | None = None, tile_overlap_factor: float | None = None
    ) -> None:
        """Decode latents larger than a tile in overlapping tiles; None keeps a parameter. As in Diffusers,
        the latent tile size follows the pixel one (`tile_sample_min_size // spatial_compression_ratio`)."""
        if tile_sample_min_size is not None and tile_sample_min_size < self.spatial_compression_ratio:
            raise ValueError(
                f"{self.diffusers_class_name}.enable_tiling: tile_sample_min_size must be at least "
                f"{self.spatial_compression_ratio} pixels, got {tile_sample_min_size}"
            )
        self._check_overlap_factor(tile_overlap_factor)
        self._enable_tiling_with(
            tile_sample_min_size=tile_sample_min_size, tile_overlap_factor=tile_overlap_factor
        )
        self.tile_latent_min_size = self.tile_sample_min_size // self.spatial_compression_ratio

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Image (B, C, H, W) in [-1, 1] -> posterior over unscaled latents (B, latent, H / r, W / r)."""
        if x.ndim != 4:
            raise ValueError(f"expected an image batch (B, C, H, W), got shape {tuple(x.shape)}")
        return DiagonalGaussian.from_moments(per_sample(self.encoder, x, self.use_slicing))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, latent, h, w) -> image (B, C, r * h, r * w), not clamped."""
        if z.ndim != 4:
            raise ValueError(f"expected image latents (B, C, h, w), got shape {tuple(z.shape)}")
        return per_sample(self._decode_one, z, self.use_slicing)

    def _decode_one(self, z: torch.Tensor) -> torch.Tensor:
        tile = self.tile_latent_min_size
        if not self.tiles_needed(z, tile, tile):
            return self.decoder(z)
        out_tile = self.tile_sample_min_size
        return run_overlapping_tiles(
            partial(_tile, self.decoder), z, (tile, tile), (out_tile, out_tile), self.tile_overlap_factor
        )


def _tile(network: nn.Module, x: torch.Tensor) -> torch.Tensor:
    decode_chunk_boundary()
    return network(x)
