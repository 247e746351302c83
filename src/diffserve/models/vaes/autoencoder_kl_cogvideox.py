"""Diffusers' `AutoencoderKLCogVideoX`: the causal 3-D VAE of CogVideoX 1.0 and 1.5 (16 latent channels, 8x
spatial and 4x temporal compression in the released folders).

    encode: video (B, 3, 1 + 4k, 8H, 8W) in [-1, 1] -> DiagonalGaussian over (B, 16, 1 + k, H, W)
    decode: latents (B, 16, 1 + k, H, W) -> video (B, 3, 1 + 4k, 8H, 8W), not clamped

Every temporal convolution is causal: a chunk of frames is preceded by the last `kernel - 1` input frames of
the chunk before it (`FrameCache`), or, on the first chunk, by copies of its own first frame. As in Diffusers,
the clip goes through the network in chunks of frames with one cache: the encoder takes 8 frames a chunk (the
first chunk also takes the `T % 8` left over), the decoder 2 latent frames a chunk (the first also takes the
`t % 2` left over). The decoder's group norms are spatially conditioned on the latent chunk itself
(`SpatialNorm3D`). The latent scaling (`* scaling_factor` after encoding, `/ scaling_factor` before decoding,
or the inverse with `invert_scale_latents`) is the pipeline's job; `scaling_factor` stays in `config`.

Its decoder does not take part in a row-split decode (`distributed/parallel_vae.py`): several ranks each
decode the whole clip. Tiling (`enable_tiling`, Diffusers' parameters and defaults: tiles of half the config's sample size, overlap
factors 1/6 over rows and 1/5 over columns) cuts each frame into spatial tiles, each run through the same
frame chunks, and stitches them with `tiling.stitch_tiles`. State-dict keys match Diffusers'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.coder_layout import CoderLayout
from diffserve.models.vaes.tiling import TilingMixin, decode_chunk_boundary, per_sample, run_tiles
from diffserve.vae_tiling import decode_chunk_output, decode_output_wanted

#: Diffusers' `AutoencoderKLCogVideoX` config keys and defaults (the released CogVideoX VAE).
COGVIDEOX_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("CogVideoXDownBlock3D",) * 4,
    "up_block_types": ("CogVideoXUpBlock3D",) * 4,
    "block_out_channels": (128, 256, 256, 512),
    "latent_channels": 16,
    "layers_per_block": 3,
    "act_fn": "silu",
    "norm_eps": 1e-6,
    "norm_num_groups": 32,
    "temporal_compression_ratio": 4,
    "sample_height": 480,
    "sample_width": 720,
    "scaling_factor": 1.15258426,
    "shift_factor": None,
    "latents_mean": None,
    "latents_std": None,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "invert_scale_latents": False,
}

#: Frames per encoder chunk and latent frames per decoder chunk (Diffusers' `num_sample_frames_batch_size`,
#: `num_latent_frames_batch_size`).
ENCODE_CHUNK_FRAMES = 8
DECODE_CHUNK_FRAMES = 2
#: A convolution whose input holds more than this many GiB (counted at 2 bytes an element, as Diffusers
#: does) runs over overlapping chunks of frames (the same result, bounded memory).
_SAFE_CONV_GIB = 2

#: One causal convolution's last input frames, kept between chunks of a clip (keyed by the module).
FrameCache = dict[nn.Module, torch.Tensor]


class SafeConv3d(nn.Conv3d):
    """A Conv3d that splits a very large input along frames, each piece with the `kernel - 1` frames before it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gib = x.numel() * 2 / 1024**3
        if gib <= _SAFE_CONV_GIB:
            return super().forward(x)
        kernel = self.kernel_size[0]
        pieces = list(torch.chunk(x, int(gib / _SAFE_CONV_GIB) + 1, dim=2))
        if kernel > 1:
            pieces = [pieces[0]] + [
                torch.cat([pieces[i - 1][:, :, -kernel + 1 :], pieces[i]], dim=2)
                for i in range(1, len(pieces))
            ]
        return torch.cat([super(SafeConv3d, self).forward(piece) for piece in pieces], dim=2)


class CausalConv3d(nn.Module):
    """Zero padding over rows and columns, causal over frames: the cached frames of the previous chunk (or
    the first frame repeated) go in front."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__()
        self.time_kernel = kernel_size
        pad = (kernel_size - 1) // 2
        self.conv = SafeConv3d(
            in_channels, out_channels, kernel_size, stride=(stride, 1, 1), padding=(0, pad, pad)
        )

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        if self.time_kernel > 1:
            before = cache.get(self)
            if before is None:
                before = x[:, :, :1].expand(-1, -1, self.time_kernel - 1, -1, -1)
            x = torch.cat([before, x], dim=2)
            cache[self] = x[:, :, -self.time_kernel + 1 :].clone()
        return self.conv(x)


class SpatialNorm3D(nn.Module):
    """GroupNorm scaled and shifted by 1x1 convolutions of the latents, resized to the features (nearest;
    the first frame on its own when the features have an odd number of frames above one)."""

    def __init__(self, f_channels: int, zq_channels: int, groups: int) -> None:
        super().__init__()
        self.norm_layer = nn.GroupNorm(groups, f_channels, eps=1e-6, affine=True)
        self.conv_y = CausalConv3d(zq_channels, f_channels, 1)
        self.conv_b = CausalConv3d(zq_channels, f_channels, 1)

    def forward(self, f: torch.Tensor, zq: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        frames = f.shape[2]
        if frames > 1 and frames % 2 == 1:
            first = F.interpolate(zq[:, :, :1], size=(1, *f.shape[-2:]))
            rest = F.interpolate(zq[:, :, 1:], size=(frames - 1, *f.shape[-2:]))
            zq = torch.cat([first, rest], dim=2)
        else:
            zq = F.interpolate(zq, size=f.shape[-3:])
        return self.norm_layer(f) * self.conv_y(zq, cache) + self.conv_b(zq, cache)


class ResnetBlock3D(nn.Module):
    """Two causal 3x3x3 convolutions after (spatial) group norms and SiLU, with a 1x1x1 shortcut when the
    width changes."""

    def __init__(
        self, in_channels: int, out_channels: int, groups: int, eps: float, spatial_norm_dim: int | None
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        if spatial_norm_dim is None:
            self.norm1: nn.Module = nn.GroupNorm(groups, in_channels, eps=eps)
            self.norm2: nn.Module = nn.GroupNorm(groups, out_channels, eps=eps)
        else:
            self.norm1 = SpatialNorm3D(in_channels, spatial_norm_dim, groups)
            self.norm2 = SpatialNorm3D(out_channels, spatial_norm_dim, groups)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3)
        if in_channels != out_channels:
            self.conv_shortcut = SafeConv3d(in_channels, out_channels, kernel_size=1)

    def _norm(
        self, norm: nn.Module, x: torch.Tensor, zq: torch.Tensor | None, cache: FrameCache
    ) -> torch.Tensor:
        return norm(x) if zq is None else norm(x, zq, cache)

    def forward(self, x: torch.Tensor, zq: torch.Tensor | None, cache: FrameCache) -> torch.Tensor:
        h = self.conv1(F.silu(self._norm(self.norm1, x, zq, cache)), cache)
        h = self.conv2(F.silu(self._norm(self.norm2, h, zq, cache)), cache)
        if self.in_channels != self.out_channels:
            x = self.conv_shortcut(x)
        return h + x


class Downsample3D(nn.Module):
    """Optionally halves the frames (average of pairs; an odd first frame kept alone), then a stride-2 3x3
    convolution per frame after padding one row and one column at the far side."""

    def __init__(self, channels: int, compress_time: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)
        self.compress_time = compress_time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compress_time:
            b, c, t, h, w = x.shape
            x = x.permute(0, 3, 4, 1, 2).reshape(b * h * w, c, t)
            if t % 2 == 1:
                rest = x[..., 1:]
                if rest.shape[-1] > 0:
                    rest = F.avg_pool1d(rest, kernel_size=2, stride=2)
                x = torch.cat([x[..., :1], rest], dim=-1)
            else:
                x = F.avg_pool1d(x, kernel_size=2, stride=2)
            x = x.reshape(b, h, w, c, x.shape[-1]).permute(0, 3, 4, 1, 2)
        x = F.pad(x, (0, 1, 0, 1))
        b, c, t, h, w = x.shape
        x = self.conv(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return x.reshape(b, t, *x.shape[1:]).permute(0, 2, 1, 3, 4)


class Upsample3D(nn.Module):
    """Nearest 2x over rows and columns (and frames with `compress_time`, the odd first frame kept single),
    then a 3x3 convolution per frame."""

    def __init__(self, channels: int, compress_time: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1)
        self.compress_time = compress_time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[2]
        if self.compress_time and frames > 1 and frames % 2 == 1:
            first = F.interpolate(x[:, :, 0], scale_factor=2.0)[:, :, None]
            x = torch.cat([first, F.interpolate(x[:, :, 1:], scale_factor=2.0)], dim=2)
        elif self.compress_time and frames > 1:
            x = F.interpolate(x, scale_factor=2.0)
        else:  # per frame, over rows and columns only
            b, c, t, h, w = x.shape
            x = F.interpolate(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w), scale_factor=2.0)
            x = x.reshape(b, t, c, *x.shape[-2:]).permute(0, 2, 1, 3, 4)
        b, c, t, h, w = x.shape
        x = self.conv(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return x.reshape(b, t, *x.shape[1:]).permute(0, 2, 1, 3, 4)


class _Level(nn.Module):
    """One encoder or decoder level: `resnets`, then the resampler (Diffusers' `downsamplers` / `upsamplers`
    list of one, absent on the last level)."""

    def __init__(self, resnets: list[ResnetBlock3D], sampler_name: str, sampler: nn.Module | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(resnets)
        self.sampler_name = sampler_name
        setattr(self, sampler_name, nn.ModuleList([sampler]) if sampler is not None else None)

    def forward(self, x: torch.Tensor, zq: torch.Tensor | None, cache: FrameCache) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, zq, cache)
        samplers = getattr(self, self.sampler_name)
        if samplers is not None:
            x = samplers[0](x)
        return x


class _MidBlock(nn.Module):
    def __init__(self, resnets: list[ResnetBlock3D]) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(resnets)

    def forward(self, x: torch.Tensor, zq: torch.Tensor | None, cache: FrameCache) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, zq, cache)
        return x


@dataclass(frozen=True)
class CogVideoXCoderLayout(CoderLayout):
    """A CogVideoX VAE half's layout (`block_out_channels` in the encoder's order for both halves; the
    encoder's `out_channels` is the latent width, its `conv_out` gives twice that), its GroupNorm `eps`
    and `groups`, and how many levels (the first ones) also resample time."""

    eps: float
    groups: int
    temporal_levels: int


class Encoder3D(nn.Module):
    def __init__(self, layout: CogVideoXCoderLayout) -> None:
        super().__init__()
        block_out_channels, eps, groups = layout.block_out_channels, layout.eps, layout.groups
        self.conv_in = CausalConv3d(layout.in_channels, block_out_channels[0], 3)
        levels, width = [], block_out_channels[0]
        for i, out in enumerate(block_out_channels):
            resnets = [
                ResnetBlock3D(width if j == 0 else out, out, groups, eps, None)
                for j in range(layout.layers_per_block)
            ]
            last = i == len(block_out_channels) - 1
            down = None if last else Downsample3D(out, compress_time=i < layout.temporal_levels)
            levels.append(_Level(resnets, "downsamplers", down))
            width = out
        self.down_blocks = nn.ModuleList(levels)
        top = block_out_channels[-1]
        self.mid_block = _MidBlock([ResnetBlock3D(top, top, groups, eps, None) for _ in range(2)])
        self.norm_out = nn.GroupNorm(groups, top, eps=1e-6)
        self.conv_out = CausalConv3d(top, 2 * layout.out_channels, 3)

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        for level in self.down_blocks:
            x = level(x, None, cache)
        x = self.mid_block(x, None, cache)
        return self.conv_out(F.silu(self.norm_out(x)), cache)


class Decoder3D(nn.Module):
    def __init__(self, layout: CogVideoXCoderLayout) -> None:
        super().__init__()
        in_channels, eps, groups = layout.in_channels, layout.eps, layout.groups
        widths = list(reversed(layout.block_out_channels))
        self.conv_in = CausalConv3d(in_channels, widths[0], 3)
        self.mid_block = _MidBlock(
            [ResnetBlock3D(widths[0], widths[0], groups, eps, in_channels) for _ in range(2)]
        )
        levels, width = [], widths[0]
        for i, out in enumerate(widths):
            resnets = [
                ResnetBlock3D(width if j == 0 else out, out, groups, eps, in_channels)
                for j in range(layout.layers_per_block + 1)
            ]
            last = i == len(widths) - 1
            up = None if last else Upsample3D(out, compress_time=i < layout.temporal_levels)
            levels.append(_Level(resnets, "upsamplers", up))
            width = out
        self.up_blocks = nn.ModuleList(levels)
        self.norm_out = SpatialNorm3D(widths[-1], in_channels, groups)
        self.conv_out = CausalConv3d(widths[-1], layout.out_channels, 3)

    def forward(self, z: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.conv_in(z, cache)
        x = self.mid_block(x, z, cache)
        for level in self.up_blocks:
            x = level(x, z, cache)
        return self.conv_out(F.silu(self.norm_out(x, z, cache)), cache)


def frame_chunks(frames: int, per_chunk: int) -> list[slice]:
    """Diffusers' frame batches: `max(frames // per_chunk, 1)` chunks of `per_chunk`, the first one also
    taking the `frames % per_chunk` left over."""
    extra = frames % per_chunk
    count = max(frames // per_chunk, 1)
    return [
        slice(per_chunk * i + (0 if i == 0 else extra), per_chunk * (i + 1) + extra) for i in range(count)
    ]


class AutoencoderKLCogVideoX(DiffusersConfigured, TilingMixin, nn.Module):
    """CogVideoX's causal video VAE with Diffusers' config keys and weight names."""

    diffusers_class_name: ClassVar[str] = "AutoencoderKLCogVideoX"
    config_defaults = COGVIDEOX_VAE_CONFIG_DEFAULTS

    def __init__(self, **config: Any) -> None:
        super().__init__()
        cfg = {**COGVIDEOX_VAE_CONFIG_DEFAULTS, **config}
        for key in ("down_block_types", "up_block_types", "block_out_channels"):
            cfg[key] = tuple(cfg[key])
        for kind, names in (("down", cfg["down_block_types"]), ("up", cfg["up_block_types"])):
            expected = f"CogVideoX{kind.capitalize()}Block3D"
            if any(name != expected for name in names) or len(names) != len(cfg["block_out_channels"]):
                raise ValueError(
                    f"AutoencoderKLCogVideoX: {kind}_block_types must be {expected}, one per block_out_channels "
                    f"entry; got {names}"
                )
        if cfg["act_fn"] not in ("silu", "swish"):
            raise ValueError(f"AutoencoderKLCogVideoX: act_fn must be silu, got {cfg['act_fn']!r}")
        quant = [key for key in ("use_quant_conv", "use_post_quant_conv") if cfg[key]]
        if quant and cfg["latent_channels"] != cfg["out_channels"]:
            raise ValueError(
                f"AutoencoderKLCogVideoX: {' and '.join(quant)} with latent_channels {cfg['latent_channels']} "
                f"!= out_channels {cfg['out_channels']}: Diffusers builds these convs over out_channels, so "
                "they cannot take the latents (it fails when it encodes or decodes); set them to false, as "
                "released"
            )
        self.config = cfg
        temporal_levels = int(math.log2(cfg["temporal_compression_ratio"]))
        common = {
            "block_out_channels": cfg["block_out_channels"],
            "layers_per_block": cfg["layers_per_block"],
            "eps": cfg["norm_eps"],
            "groups": cfg["norm_num_groups"],
            "temporal_levels": temporal_levels,
        }
        self.encoder = Encoder3D(CogVideoXCoderLayout(cfg["in_channels"], cfg["latent_channels"], **common))
        self.decoder = Decoder3D(CogVideoXCoderLayout(cfg["latent_channels"], cfg["out_channels"], **common))
        out = cfg["out_channels"]  # Diffusers sizes both optional convs by out_channels
        self.quant_conv = SafeConv3d(2 * out, 2 * out, 1) if cfg["use_quant_conv"] else None
        self.post_quant_conv = SafeConv3d(out, out, 1) if cfg["use_post_quant_conv"] else None
        ratio = self.spatial_compression_ratio
        self.tile_sample_min_height = cfg["sample_height"] // 2
        self.tile_sample_min_width = cfg["sample_width"] // 2
        self.tile_latent_min_height = int(self.tile_sample_min_height / ratio)
        self.tile_latent_min_width = int(self.tile_sample_min_width / ratio)
        self.tile_overlap_factor_height = 1 / 6
        self.tile_overlap_factor_width = 1 / 5

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side: 2 per downsampling level (8 for the released VAE)."""
        return 2 ** (len(self.config["block_out_channels"]) - 1)

    @property
    def temporal_compression_ratio(self) -> int:
        """Frames per latent frame after the first (4): T = 1 + ratio * (t - 1)."""
        return int(self.config["temporal_compression_ratio"])

    def enable_tiling(
        self,
        tile_sample_min_height: int | None = None,
        tile_sample_min_width: int | None = None,
        tile_overlap_factor_height: float | None = None,
        tile_overlap_factor_width: float | None = None,
    ) -> None:
        """Encode / decode frames larger than a tile in overlapping spatial tiles (Diffusers' parameters);
        None keeps a parameter."""
        self._enable_tiling_with(
            tile_sample_min_height=tile_sample_min_height,
            tile_sample_min_width=tile_sample_min_width,
            tile_overlap_factor_height=tile_overlap_factor_height,
            tile_overlap_factor_width=tile_overlap_factor_width,
        )
        ratio = self.spatial_compression_ratio
        self.tile_latent_min_height = int(self.tile_sample_min_height / ratio)
        self.tile_latent_min_width = int(self.tile_sample_min_width / ratio)

    # -- encode ---------------------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Video (B, C, T, H, W) in [-1, 1] -> posterior over unscaled latents."""
        if x.ndim != 5:
            raise ValueError(f"expected a video batch (B, C, T, H, W), got shape {tuple(x.shape)}")
        return DiagonalGaussian.from_moments(per_sample(self._encode_clip, x, self.use_slicing))

    def _encode_frames(self, x: torch.Tensor) -> torch.Tensor:
        cache: FrameCache = {}
        out = []
        for chunk in frame_chunks(x.shape[2], ENCODE_CHUNK_FRAMES):
            moments = self.encoder(x[:, :, chunk], cache)
            out.append(self.quant_conv(moments) if self.quant_conv is not None else moments)
        return torch.cat(out, dim=2)

    def _encode_clip(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tiles_needed(x, self.tile_sample_min_height, self.tile_sample_min_width):
            return self._encode_frames(x)
        return self._tiled(
            self._encode_frames,
            x,
            (self.tile_sample_min_height, self.tile_sample_min_width),
            (self.tile_latent_min_height, self.tile_latent_min_width),
        )

    # -- decode ---------------------------------------------------------------------------------------------

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, C, t, h, w) -> video (B, 3, 1 + 4 (t - 1), 8h, 8w), not clamped."""
        if z.ndim != 5:
            raise ValueError(f"expected video latents (B, C, t, h, w), got shape {tuple(z.shape)}")
        return per_sample(self._decode_clip, z, self.use_slicing)

    def _decode_frames(self, z: torch.Tensor, publish: bool = False) -> torch.Tensor:
        """The decoder over chunks of latent frames with one causal cache, each chunk a decode chunk
        (`decode_chunk_boundary` before it); with `publish` its pixels are handed out as they come."""
        cache: FrameCache = {}
        publish = publish and decode_output_wanted()
        out = []
        for chunk in frame_chunks(z.shape[2], DECODE_CHUNK_FRAMES):
            decode_chunk_boundary()
            piece = z[:, :, chunk]
            if self.post_quant_conv is not None:
                piece = self.post_quant_conv(piece)
            out.append(self.decoder(piece, cache))
            if publish:
                decode_chunk_output(out[-1].clamp(-1.0, 1.0))
        return torch.cat(out, dim=2)

    def _decode_clip(self, z: torch.Tensor) -> torch.Tensor:
        if not self.tiles_needed(z, self.tile_latent_min_height, self.tile_latent_min_width):
            return self._decode_frames(z, publish=True)
        return self._tiled(
            self._decode_frames,
            z,
            (self.tile_latent_min_height, self.tile_latent_min_width),
            (self.tile_sample_min_height, self.tile_sample_min_width),
        )

    def _tiled(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        tile: tuple[int, int],
        out_tile: tuple[int, int],
    ) -> torch.Tensor:
        """`fn` on overlapping tiles of `tile` (in `x`'s units), stitched as Diffusers does: tiles start every
        `int(tile * (1 - overlap))`, `int(out_tile * overlap)` output rows / columns are cross-faded and the
        rest of one output tile kept; not cropped (Diffusers does not crop)."""
        overlap = (self.tile_overlap_factor_height, self.tile_overlap_factor_width)
        stride = (int(tile[0] * (1 - overlap[0])), int(tile[1] * (1 - overlap[1])))
        blend = (int(out_tile[0] * overlap[0]), int(out_tile[1] * overlap[1]))
        keep = (out_tile[0] - blend[0], out_tile[1] - blend[1])
        return run_tiles(fn, x, tile, stride, blend, keep)
