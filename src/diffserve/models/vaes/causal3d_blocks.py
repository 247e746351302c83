"""The causal 3-D convolutional KL autoencoder shared by two families: its building blocks and the
network they make (`CausalVideoVAE`). Wan 2.1's VAE (`autoencoder_kl_wan.py`) and Qwen-Image's
fine-tune of it (`autoencoder_kl_qwen_image.py`) are this network under their own Diffusers class names
and config keys. Architecture:

    encode: video (B, 3, T, H, W) in [-1, 1]
        -> Encoder3d, run on frame 0 alone, then on chunks of 4 frames      (causal convs carry a cache)
        -> quant_conv (1x1x1)  -> DiagonalGaussian over (B, z_dim, 1 + (T - 1) / 4, H / 8, W / 8)
    decode: latents (B, z_dim, t, h, w)
        -> post_quant_conv (1x1x1) -> Decoder3d, run one latent frame at a time
        -> clamp to [-1, 1]    -> video (B, 3, 1 + (t - 1) * 4, h * 8, w * 8)

(/4 and /8 for the released config: three downsamplings, the last two also temporal.) Images are
single-frame videos (T = 1). The chunking is the one Diffusers uses, so results match it, and memory
stays bounded by the chunk size rather than the clip length. As in Diffusers, trailing frames that do
not complete a chunk of 4 are not encoded: pass 1 + 4k frames. The latent normalisation
((z - latents_mean) / latents_std) is the pipeline's job, as in Diffusers; the config's values are
exposed as `latents_mean` / `latents_std`.

Tiling and slicing are Diffusers' (`tiling.py`): `enable_tiling(tile_sample_min_height=256,
tile_sample_min_width=256, tile_sample_stride_height=192, tile_sample_stride_width=192)` cuts frames larger
than a tile into overlapping spatial tiles, each decoded (encoded) over the whole clip with its own causal
cache, and cross-fades the overlaps; time needs no tiling (the decoder already runs one latent frame at a
time). For Wan 2.2 the tile sizes count pixels after its 2x2 patch folding, as in Diffusers. Unlike Diffusers'
Qwen-Image class, the tiled decode is clamped to [-1, 1] like the untiled one (pipelines clamp anyway).
`enable_slicing()` encodes / decodes a batch one clip at a time.

Every convolution that looks along time is *causal*: output frame t sees input frames <= t only
(the kernel's temporal padding all goes in front). That lets a clip be encoded or decoded a chunk of
frames at a time, which keeps memory bounded for long videos: each causal conv remembers the last
`CACHE_FRAMES` frames of its input from the previous chunk and puts them in front of the next one,
so chunked processing gives the same result as processing the whole clip with that padding.

That memory lives in a `CausalCache` created for one clip and passed down explicitly; each layer
keys its entry by itself. (Diffusers keeps a flat list and a shared running index instead; the
values stored and read are the same, so the numbers are too.)

Layout: activations are (batch, channels, frames, height, width). Spatial-only pieces (up/down
sampling convs, attention) fold frames into the batch and run 2-D ops per frame.

Module and parameter names follow Diffusers (`resnets.0.norm1.gamma`, `resample.1.weight`,
`time_conv.weight`, `to_qkv`, `proj`) so checkpoints load with `strict=True` and no renaming.
Only inference is kept: no dropout, no gradient checkpointing. Nothing is computed from parameter
values at construction, so everything builds on the meta device.

Row-split decode over several ranks (`diffserve.distributed.parallel_vae`): the spatial convolutions
take halo rows from the neighbouring ranks (a causal conv caches its own rows only and exchanges the
halo of cached and new frames together), the per-frame attention attends over every rank's keys and
values; the channel RMS norms, nearest upsampling and temporal convs are local to a row already.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import pairwise
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.distributed.parallel_vae import (
    HaloConv2d,
    check_halo_conv,
    current_row_split,
    gather_tokens,
    with_halo_rows,
)
from diffserve.layers.attention import attention
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.blocks import ResnetStage, resnet_chain
from diffserve.models.vaes.tiling import StridedTilingMixin, decode_chunk_boundary, per_sample
from diffserve.vae_tiling import decode_chunk_output, decode_output_wanted

#: Frames of input each causal conv keeps for the next chunk: a temporal kernel of 3 needs 2.
CACHE_FRAMES = 2


class CausalCache:
    """What every causal layer remembers of the previous chunk of one clip; start a new one per clip.

    An entry can exist with value None: the layer has seen the clip's first chunk but keeps no
    frames yet (the temporal upsampler uses that to tell "first chunk" from "later chunk").
    """

    def __init__(self) -> None:
        self._frames: dict[nn.Module, torch.Tensor | None] = {}

    def __contains__(self, layer: nn.Module) -> bool:
        return layer in self._frames

    def get(self, layer: nn.Module) -> torch.Tensor | None:
        return self._frames.get(layer)

    def put(self, layer: nn.Module, frames: torch.Tensor | None) -> None:
        self._frames[layer] = frames


def _per_frame(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run a 2-D module on every frame: (B, C, T, H, W) -> (B*T, C, H, W) -> module -> (B, C', T, H', W')."""
    b, c, t, h, w = x.shape
    y = module(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
    return y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


class CausalConv3d(nn.Conv3d):
    """3-D conv whose temporal padding is all in front; with a cache, the front comes from the last chunk.

    Spatial padding is symmetric zeros, applied with `F.pad` together with the temporal one (as
    Diffusers does, so the convolution sees the very same padded tensor).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] = 0,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        pad_t, pad_h, pad_w = (padding,) * 3 if isinstance(padding, int) else padding
        self.time_pad = 2 * pad_t
        self.space_pad = (pad_w, pad_w, pad_h, pad_h)

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        time_pad = self.time_pad
        if cache is not None and time_pad > 0:
            previous = cache.get(self)
            cache.put(self, self._frames_to_keep(x, previous))
            if previous is not None:
                x = torch.cat([previous, x], dim=2)
                time_pad -= previous.shape[2]
        space_pad = self.space_pad
        split = current_row_split()
        if split is not None and space_pad[2]:
            # Row-split decode: the cache above holds this rank's own rows; the halo rows of the frames
            # (cached and new alike) come from the neighbours, in place of the zero row padding.
            check_halo_conv(self, space_pad[2])
            x = with_halo_rows(x, space_pad[2], split)
            space_pad = (space_pad[0], space_pad[1], 0, 0)
        if x.shape[2] == 1 and time_pad == self.kernel_size[0] - 1 and self.stride[0] == 1:
            return self._one_frame(x, space_pad)
        if time_pad or any(space_pad):
            x = F.pad(x, (*space_pad, time_pad, 0))
        return super().forward(x)

    def _one_frame(self, x: torch.Tensor, space_pad: tuple[int, int, int, int]) -> torch.Tensor:
        """One frame behind all-zero temporal padding (an image, or a clip's first frame): only the kernel's
        last temporal slice meets data, so this is a 2-D convolution with that slice, a third of the work of
        the padded 3-D one and the same sum less its zero terms."""
        frame = F.pad(x[:, :, 0], space_pad) if any(space_pad) else x[:, :, 0]
        weight = self.weight[:, :, -1]
        out = F.conv2d(frame, weight, self.bias, self.stride[1:], 0, self.dilation[1:], self.groups)
        return out.unsqueeze(2)

    @staticmethod
    def _frames_to_keep(x: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """The last CACHE_FRAMES input frames, topped up from the previous chunk when this one is shorter."""
        tail = x[:, :, -CACHE_FRAMES:]
        if tail.shape[2] < CACHE_FRAMES and previous is not None:
            return torch.cat([previous[:, :, -1:], tail], dim=2)
        # A copy: the caller's tensor must not be kept alive (or be changed under us) through a view.
        return tail.clone()


class ChannelRMSNorm(nn.Module):
    """L2-normalise over channels (dim 1), times sqrt(channels) and a learned per-channel gain `gamma`.

    This equals RMS normalisation with the epsilon applied to the norm rather than the mean square
    (`F.normalize`'s 1e-12); half-precision inputs are normalised in fp32 and rounded back, as in Diffusers.
    `spatial_dims` is how many trailing dims follow the channels (3 for video, 2 for per-frame images);
    it only shapes `gamma` so the checkpoint tensor loads as is.
    """

    def __init__(self, dim: int, spatial_dims: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *([1] * spatial_dims)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        upcast = x.dtype in (torch.float16, torch.bfloat16) or str(x.dtype).startswith(
            ("torch.float8", "torch.float4")
        )
        normalized = normalize_channels(x.float() if upcast else x).to(x.dtype)
        return normalized * self.scale * self.gamma


def normalize_channels(x: torch.Tensor) -> torch.Tensor:
    """`F.normalize(x, dim=1)`. On the CPU the squared norm is summed channel by channel instead: torch's
    CPU norm kernel reduces the strided channel axis slowly (2-8x slower at a VAE's widths and sizes),
    while a running sum of channel products streams through memory and needs no full-size temporary. The
    same maths; the sum's float rounding may differ in the last bit."""
    if x.device.type != "cpu" or x.shape[1] == 0:
        return F.normalize(x, dim=1)
    squared = x[:, 0].square()
    for channel in range(1, x.shape[1]):
        squared.addcmul_(x[:, channel], x[:, channel])
    return x / squared.sqrt_().clamp_min_(1e-12).unsqueeze(1)


class RMSResidualLayers(nn.Module):
    """The layers of Wan's residual block over (B, C, T, H, W) tensors: an RMSNorm and a 3-wide conv twice,
    plus a 1-wide shortcut conv when the width changes. A subclass names its convolution (`conv_cls`, whose
    weights set the checkpoint's shapes) and runs the layers in `forward`."""

    conv_cls: ClassVar[type[nn.Conv2d] | type[nn.Conv3d]]

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        conv = self.conv_cls
        self.norm1 = ChannelRMSNorm(in_dim, spatial_dims=3)
        self.conv1 = conv(in_dim, out_dim, 3, padding=1)
        self.norm2 = ChannelRMSNorm(out_dim, spatial_dims=3)
        self.conv2 = conv(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = conv(in_dim, out_dim, 1) if in_dim != out_dim else None


class ResidualBlock(RMSResidualLayers):
    """(RMSNorm, SiLU, causal 3x3x3 conv) twice, plus a 1x1x1 shortcut when the width changes."""

    conv_cls = CausalConv3d

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        # The norms return fresh tensors, so SiLU may overwrite them (the convs cache copies, not views).
        h = self.conv1(F.silu(self.norm1(x), inplace=True), cache)
        h = self.conv2(F.silu(self.norm2(h), inplace=True), cache)
        return h + shortcut


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (no attention across time), residual.

    Attention never mixes frames, so it needs no cache; `cache` is accepted only so every encoder
    layer has the same call signature.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ChannelRMSNorm(dim, spatial_dims=2)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        # Attention output first: the sum then takes its (frame-major) memory layout, as in Diffusers,
        # and the convolutions after it round the same way.
        return _per_frame(self._attend, x) + x

    def _attend(self, frames: torch.Tensor) -> torch.Tensor:
        n, c, h, w = frames.shape
        qkv = self.to_qkv(self.norm(frames)).flatten(2).transpose(1, 2).contiguous()  # (n, h*w, 3c)
        q, k, v = qkv.chunk(3, dim=-1)  # (n, h*w, c) each
        # In a row-split decode the queries stay local and the keys and values are every rank's.
        q, k, v = q.unsqueeze(2), gather_tokens(k, w).unsqueeze(2), gather_tokens(v, w).unsqueeze(2)
        out = attention(q, k, v).flatten(2)  # (n, h*w, c)
        return self.proj(out.transpose(1, 2).reshape(n, c, h, w))


class MidBlock(nn.Module):
    """resnet -> attention -> resnet at the lowest resolution."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x)
        return self.resnets[1](x, cache)


class _NearestUpsample2x(nn.Module):
    """2x nearest-neighbour upsampling, computed in fp32 and rounded back (as Diffusers does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)


class Upsample(nn.Module):
    """2x spatial upsampling that halves the width (or maps it to `out_dim`); with `temporal`, frames are
    doubled first.

    Temporal doubling: a causal (3, 1, 1) conv makes two channel groups per frame, interleaved into
    two frames. The clip's first frame is not doubled (a video of 1 + 4k frames has latents of
    1 + k frames), so the first chunk skips the conv and only marks the cache.
    """

    def __init__(self, dim: int, temporal: bool, out_dim: int | None = None) -> None:
        super().__init__()
        # Sequential only for the Diffusers name `resample.1` of the conv.
        out_dim = dim // 2 if out_dim is None else out_dim
        self.resample = nn.Sequential(_NearestUpsample2x(), HaloConv2d(dim, out_dim, 3, padding=1))
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0)) if temporal else None

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        if self.time_conv is not None:
            x = self._double_frames(x, cache)
        return _per_frame(self.resample, x)

    def _double_frames(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        if self.time_conv not in cache:
            cache.put(self.time_conv, None)
            return x
        b, c, t, h, w = x.shape
        pairs = self.time_conv(x, cache).view(b, 2, c, t, h, w)
        # (b, 2, c, t, ...) -> (b, c, t, 2, ...): frame i becomes frames 2i (group 0) and 2i + 1 (group 1).
        return pairs.permute(0, 2, 3, 1, 4, 5).reshape(b, c, t * 2, h, w)


class Downsample(nn.Module):
    """Stride-2 spatial downsampling (pad bottom/right, 3x3 conv); with `temporal`, also stride 2 in time.

    Temporal: a (3, 1, 1) stride-2 conv over [last frame of the previous chunk, this chunk]. The
    clip's first chunk (its first frame) passes through unchanged and is only remembered.
    """

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        # Sequential only for the Diffusers name `resample.1` of the conv.
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = _per_frame(self.resample, x)
        if self.time_conv is None:
            return x
        previous = cache.get(self.time_conv)
        cache.put(self.time_conv, x[:, :, -1:].clone())
        if previous is None:
            return x
        return self.time_conv(torch.cat([previous, x], dim=2))


class UpBlock(ResnetStage):
    """`num_res_blocks + 1` residual blocks, then an optional `Upsample` (which halves the width); its
    forward takes the clip's `CausalCache` after the input."""

    resamplers_name = "upsamplers"


class SpaceTimeToChannels(nn.Module):
    """Wan 2.2's parameter-free down shortcut (Diffusers' `AvgDown3D`): fold each (factor_t, factor_s,
    factor_s) cell of space-time into channels, then average consecutive groups of those channels down to
    `out_channels`. Frames are zero-padded in front to a multiple of `factor_t` (a clip's first frame,
    alone in its chunk, is averaged with a zero frame)."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int) -> None:
        super().__init__()
        cell = factor_t * factor_s * factor_s
        if in_channels * cell % out_channels:
            raise ValueError(
                f"{in_channels} channels times the {cell}-cell space-time fold do not divide into {out_channels}"
            )
        self.out_channels, self.factor_t, self.factor_s = out_channels, factor_t, factor_s
        self.group = in_channels * cell // out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        x = F.pad(x, (0, 0, 0, 0, (-x.shape[2]) % ft, 0))
        b, c, t, h, w = x.shape
        cells = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        return cells.reshape(b, self.out_channels, self.group, t // ft, h // fs, w // fs).mean(dim=2)


class ChannelsToSpaceTime(nn.Module):
    """Wan 2.2's parameter-free up shortcut (Diffusers' `DupUp3D`), the mirror of `SpaceTimeToChannels`:
    repeat every channel, then unfold channel groups into (factor_t, factor_s, factor_s) cells. On a
    clip's first chunk only the last of the `factor_t` new frames is kept (its first frame is not doubled)."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int) -> None:
        super().__init__()
        cell = factor_t * factor_s * factor_s
        if out_channels * cell % in_channels:
            raise ValueError(
                f"{out_channels} channels times a {cell}-cell unfold are no multiple of {in_channels}"
            )
        self.out_channels, self.factor_t, self.factor_s = out_channels, factor_t, factor_s
        self.repeats = out_channels * cell // in_channels

    def forward(self, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        b, _, t, h, w = x.shape
        x = x.repeat_interleave(self.repeats, dim=1).view(b, self.out_channels, ft, fs, fs, t, h, w)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.out_channels, t * ft, h * fs, w * fs)
        return x[:, :, ft - 1 :] if first_chunk else x


class ResidualDownBlock(nn.Module):
    """One Wan 2.2 encoder level: residual blocks and an optional `Downsample`, plus a
    `SpaceTimeToChannels` shortcut of the level's input around all of them."""

    def __init__(
        self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, downsample: bool
    ) -> None:
        super().__init__()
        self.avg_shortcut = SpaceTimeToChannels(
            in_dim, out_dim, factor_t=2 if temporal else 1, factor_s=2 if downsample else 1
        )
        self.resnets = nn.ModuleList(resnet_chain(ResidualBlock, in_dim, out_dim, num_res_blocks))
        self.downsampler = Downsample(out_dim, temporal=temporal) if downsample else None

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h, cache)
        if self.downsampler is not None:
            h = self.downsampler(h, cache)
        return h + self.avg_shortcut(x)


class ResidualUpBlock(nn.Module):
    """One Wan 2.2 decoder level: `num_res_blocks + 1` residual blocks and an optional `Upsample` that keeps
    the width, plus a `ChannelsToSpaceTime` shortcut of the level's input around them."""

    def __init__(
        self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, upsample: bool
    ) -> None:
        super().__init__()
        self.avg_shortcut = (
            ChannelsToSpaceTime(in_dim, out_dim, factor_t=2 if temporal else 1, factor_s=2)
            if upsample
            else None
        )
        self.resnets = nn.ModuleList(resnet_chain(ResidualBlock, in_dim, out_dim, num_res_blocks + 1))
        self.upsampler = Upsample(out_dim, temporal=temporal, out_dim=out_dim) if upsample else None

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        first_chunk = self not in cache  # the decoder runs one latent frame at a time
        cache.put(self, None)
        h = x
        for resnet in self.resnets:
            h = resnet(h, cache)
        if self.upsampler is None:
            return h
        h = self.upsampler(h, cache)
        assert self.avg_shortcut is not None
        return h + self.avg_shortcut(x, first_chunk)


class Encoder3d(nn.Module):
    """Video (B, in_channels, T, H, W) -> (B, out_channels, 1 + (T - 1) / 2^k, H / 2^n, W / 2^n).

    n = len(dim_mult) - 1 downsamplings, k of them temporal (`temporal_downsample`). `down_blocks` is
    one flat list (residual blocks, optional attention at `attn_scales`, downsamplers), as in Diffusers;
    with `residual` (Wan 2.2) it is one `ResidualDownBlock` per level instead, and `attn_scales` is unused.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        dim: int,
        dim_mult: Sequence[int],
        num_res_blocks: int,
        attn_scales: Sequence[float],
        temporal_downsample: Sequence[bool],
        residual: bool = False,
    ) -> None:
        super().__init__()
        dims = [dim * m for m in (1, *dim_mult)]
        self.conv_in = CausalConv3d(in_channels, dims[0], 3, padding=1)
        layers: list[nn.Module] = []
        scale = 1.0
        last = len(dim_mult) - 1
        for level, (in_dim, out_dim) in enumerate(pairwise(dims)):
            if residual:  # Wan 2.2: one block per level (no attention), the shortcut around it
                temporal = bool(temporal_downsample[level]) if level != last else False
                layers.append(ResidualDownBlock(in_dim, out_dim, num_res_blocks, temporal, level != last))
                continue
            for _ in range(num_res_blocks):
                layers.append(ResidualBlock(in_dim, out_dim))
                if scale in attn_scales:
                    layers.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if level != len(dim_mult) - 1:
                layers.append(Downsample(out_dim, temporal=temporal_downsample[level]))
                scale /= 2.0
        self.down_blocks = nn.ModuleList(layers)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = ChannelRMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(dims[-1], out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        for layer in self.down_blocks:
            x = layer(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True), cache)


class Decoder3d(nn.Module):
    """Latents (B, z_dim, t, h, w) -> video (B, out_channels, 1 + (t - 1) * 2^k, h * 2^n, w * 2^n).

    Mirrors the encoder. Each upsampler halves the width, so every up block after the first starts
    at half the previous block's width; with `residual` (Wan 2.2) the upsamplers keep it and each level
    is a `ResidualUpBlock`.
    """

    def __init__(
        self,
        z_dim: int,
        out_channels: int,
        dim: int,
        dim_mult: Sequence[int],
        num_res_blocks: int,
        temporal_upsample: Sequence[bool],
        residual: bool = False,
    ) -> None:
        super().__init__()
        dims = [dim * m for m in (dim_mult[-1], *reversed(dim_mult))]
        self.conv_in = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks: list[nn.Module] = []
        last = len(dim_mult) - 1
        for level, (in_dim, out_dim) in enumerate(pairwise(dims)):
            if residual:  # Wan 2.2: the upsamplers keep the width, a shortcut goes around each level
                temporal = bool(temporal_upsample[level]) if level != last else False
                blocks.append(ResidualUpBlock(in_dim, out_dim, num_res_blocks, temporal, level != last))
                continue
            if level > 0:
                in_dim //= 2
            resnets = resnet_chain(ResidualBlock, in_dim, out_dim, num_res_blocks + 1)
            upsampler = Upsample(out_dim, temporal=temporal_upsample[level]) if level != last else None
            blocks.append(UpBlock(resnets, upsampler))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = ChannelRMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = CausalConv3d(dims[-1], out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv_in(z, cache)
        x = self.mid_block(x, cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True), cache)


#: Per-channel latent statistics of the released Wan 2.1 VAE, which Qwen-Image's fine-tune keeps (Diffusers'
#: defaults for both).
LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

#: Encoder chunk length after the first frame: two temporal downsamplings turn 4 frames into 1 latent.
ENCODE_CHUNK_FRAMES = 4


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, C * patch^2, T, H / patch, W / patch), channels ordered (C, column, row) within
    a patch, as Wan 2.2's VAE expects."""
    b, c, t, h, w = x.shape
    if h % patch or w % patch:
        raise ValueError(f"height {h} and width {w} must be multiples of the VAE patch size {patch}")
    x = x.view(b, c, t, h // patch, patch, w // patch, patch).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * patch * patch, t, h // patch, w // patch)


def unpatchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, cp, t, h, w = x.shape
    x = x.view(b, cp // (patch * patch), patch, patch, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cp // (patch * patch), t, h * patch, w * patch)


class CausalVideoVAE(StridedTilingMixin, nn.Module):
    """The Wan 2.1 network, or with `residual` and `patch_size` Wan 2.2's; subclasses map their Diffusers
    config onto it and set `config`."""

    config: dict[str, Any]
    #: Its decoder's layers take part in a row-split decode (`distributed/parallel_vae.py`).
    decodes_row_split: ClassVar[bool] = True

    def __init__(
        self,
        *,
        in_channels: int,
        out_channels: int,
        encoder_dim: int,
        decoder_dim: int,
        z_dim: int,
        dim_mult: Sequence[int],
        num_res_blocks: int,
        attn_scales: Sequence[float],
        temporal_downsample: Sequence[bool],
        latents_mean: Sequence[float],
        latents_std: Sequence[float],
        residual: bool = False,
        patch_size: int | None = None,
    ) -> None:
        super().__init__()
        if len(temporal_downsample) != len(dim_mult) - 1:
            raise ValueError(
                f"temperal_downsample needs one entry per downsampling ({len(dim_mult) - 1} for "
                f"dim_mult {tuple(dim_mult)}), got {tuple(temporal_downsample)}"
            )
        self.z_dim = z_dim
        self.latents_mean = [float(v) for v in latents_mean]
        self.latents_std = [float(v) for v in latents_std]
        self._temporal_downsamplings = sum(bool(t) for t in temporal_downsample)
        self._spatial_downsamplings = len(temporal_downsample)
        #: Wan 2.2: pixels are folded into channels in `patch_size`^2 cells before the encoder (and unfolded
        #: after the decoder); None (Wan 2.1) folds nothing.
        self.patch_size = patch_size
        # Diffusers' tile defaults (pixels; used once `enable_tiling()` sets `use_tiling`).
        self.tile_sample_min_height = 256
        self.tile_sample_min_width = 256
        self.tile_sample_stride_height = 192
        self.tile_sample_stride_width = 192

        self.encoder = Encoder3d(
            in_channels,
            2 * z_dim,
            encoder_dim,
            dim_mult,
            num_res_blocks,
            attn_scales,
            temporal_downsample,
            residual,
        )
        self.quant_conv = CausalConv3d(2 * z_dim, 2 * z_dim, 1)
        self.post_quant_conv = CausalConv3d(z_dim, z_dim, 1)
        self.decoder = Decoder3d(
            z_dim,
            out_channels,
            decoder_dim,
            dim_mult,
            num_res_blocks,
            tuple(reversed(temporal_downsample)),
            residual,
        )

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (8 for Wan 2.1's VAE, 16 for Wan 2.2's with its 2x2 patches)."""
        return 2**self._spatial_downsamplings * (self.patch_size or 1)

    @property
    def temporal_compression_ratio(self) -> int:
        """Frames per latent frame after the first one (4 for the released VAEs): T = 1 + ratio * (t - 1)."""
        return 2**self._temporal_downsamplings

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Video (B, C, T, H, W) in [-1, 1] -> posterior over unnormalised latents (B, z_dim, t, H/8, W/8).

        T should be 1 + 4k (T = 1 for an image); trailing frames past the last full chunk are
        ignored, as in Diffusers. H and W should be multiples of `spatial_compression_ratio`.
        """
        if x.ndim != 5:
            raise ValueError(f"expected a video batch (B, C, T, H, W), got shape {tuple(x.shape)}")
        return DiagonalGaussian.from_moments(per_sample(self._encode_moments, x, self.use_slicing))

    def _encode_moments(self, x: torch.Tensor) -> torch.Tensor:
        if self.patch_size is not None:
            x = patchify(x, self.patch_size)
        if self.tiles_needed(x, self.tile_sample_min_height, self.tile_sample_min_width):
            return self._tiled_encode(x)
        return self.quant_conv(self._encode_chunks(x))

    def _encode_chunks(self, x: torch.Tensor, quant_each: bool = False) -> torch.Tensor:
        """The encoder over frame 0, then chunks of 4 frames, with one causal cache; with `quant_each`,
        quant_conv on each chunk's output (as Diffusers' tiled encode applies it), else none."""
        cache = CausalCache()
        n = ENCODE_CHUNK_FRAMES
        chunks = [x[:, :, :1]]
        chunks += [x[:, :, 1 + n * i : 1 + n * (i + 1)] for i in range((x.shape[2] - 1) // n)]
        outputs = [self.encoder(chunk, cache) for chunk in chunks]
        return torch.cat([self.quant_conv(out) for out in outputs] if quant_each else outputs, dim=2)

    def _tiled_encode(self, x: torch.Tensor) -> torch.Tensor:
        """Moments of (patchified) `x` from overlapping pixel tiles, blended in latents (Diffusers' tiled_encode)."""
        height, width = x.shape[-2:]
        ratio = self.spatial_compression_ratio // (self.patch_size or 1)  # of the patchified input
        encode = partial(self._encode_chunks, quant_each=True)
        moments = self.run_strided_tiles(encode, x, in_scale=1, out_scale=ratio)
        return moments[..., : height // ratio, : width // ratio]

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unnormalised latents (B, z_dim, t, h, w) -> video (B, C, 1 + 4 (t - 1), 8h, 8w) clamped to [-1, 1]."""
        if z.ndim != 5:
            raise ValueError(f"expected video latents (B, z_dim, t, h, w), got shape {tuple(z.shape)}")
        return per_sample(self._decode_clip, z, self.use_slicing)

    def _decode_clip(self, z: torch.Tensor) -> torch.Tensor:
        ratio = self.spatial_compression_ratio
        tiled = self.tiles_needed(
            z, self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio
        )
        video = self._tiled_decode(z) if tiled else self._decode_frames(z, publish=True)
        if self.patch_size is not None:
            video = unpatchify(video, self.patch_size)
        return video.clamp_(-1.0, 1.0)

    def _decode_frames(self, z: torch.Tensor, publish: bool = False) -> torch.Tensor:
        """`decode_frames` over a whole clip (a new causal cache); with `publish` (the whole clip, untiled)
        each frame's final pixels are handed out (`decode_chunk_output`)."""
        on_frame = decode_chunk_output if publish and decode_output_wanted() else None
        return self.decode_frames(z, CausalCache(), on_frame)

    def decode_frames(
        self,
        z: torch.Tensor,
        cache: CausalCache,
        on_frame: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Unnormalised latent frames (B, z_dim, t, h, w) that continue the clip `cache` has seen (a new
        cache: the clip's first frames) -> their pixels before unpatchify and clamp: post_quant_conv, then
        the decoder one latent frame at a time, updating `cache`. Each latent frame is a decode chunk
        (`decode_chunk_boundary` before it); `on_frame` gets each one's final pixels (unpatchified,
        clamped to [-1, 1]) once it is decoded. The whole-clip decode and SkyReels-V2 diffusion forcing's
        window-by-window decode (`skyreels_v2_forcing_decode.py`) both run this loop."""
        x = self.post_quant_conv(z)
        frames = []
        for i in range(x.shape[2]):
            decode_chunk_boundary()
            frames.append(self.decoder(x[:, :, i : i + 1], cache))
            if on_frame is not None:
                chunk = frames[-1] if self.patch_size is None else unpatchify(frames[-1], self.patch_size)
                on_frame(chunk.clamp(-1.0, 1.0))
        return torch.cat(frames, dim=2)

    def _tiled_decode(self, z: torch.Tensor) -> torch.Tensor:
        """`_decode_frames` on overlapping latent tiles, blended (Diffusers' tiled_decode); before unpatchify
        and clamp, so its sizes count patchified pixels."""
        height, width = z.shape[-2:]
        ratio, patch = self.spatial_compression_ratio, self.patch_size or 1
        video = self.run_strided_tiles(self._decode_frames, z, in_scale=ratio, out_scale=patch)
        return video[..., : height * ratio // patch, : width * ratio // patch]
