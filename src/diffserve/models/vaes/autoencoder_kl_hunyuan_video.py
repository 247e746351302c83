"""Diffusers' `AutoencoderKLHunyuanVideo`: HunyuanVideo's (1.0) causal video VAE (16 latent channels, 8x
spatial and 4x temporal compression).

    encode: video (B, 3, 1 + 4k, 8H, 8W) in [-1, 1] -> DiagonalGaussian over (B, 16, 1 + k, H, W)
    decode: latents (B, 16, 1 + k, H, W) -> video (B, 3, 1 + 4k, 8H, 8W), roughly in [-1, 1], not clamped

The latent scaling (`/ scaling_factor` before decoding) is the pipeline's job; `scaling_factor` is kept in
`config`. There are no latent mean / std statistics.

Long clips, as Diffusers does by default (its "framewise" decoding and encoding, always on): a latent clip
longer than `tile_sample_min_num_frames / 4` frames is decoded in overlapping chunks of that many + 1
latent frames, one every `tile_sample_stride_num_frames / 4`; each chunk after the first drops its first
decoded frame, and `tile_sample_min_num_frames - tile_sample_stride_num_frames` frames of neighbouring
chunks are cross-faded (`tiling.blend_t`). Encoding mirrors it. This changes the numbers (every chunk's
causal convs restart), so it is kept exactly, with Diffusers' defaults (16 and 12 frames).

Spatial tiling (`enable_tiling`, Diffusers' parameters and defaults: 256-pixel tiles every 192 pixels) cuts
frames larger than a tile into overlapping tiles stitched with `tiling.run_strided_tiles`, within each
temporal chunk, as Diffusers does; slicing encodes / decodes a batch one element at a time. The network is
in `hunyuan_video_blocks.py`; state-dict keys match Diffusers'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.autoencoder_kl_hunyuan_video15 import HunyuanVideoVaeShapes, decode_tile
from diffserve.models.vaes.hunyuan_video_blocks import Decoder3D, Encoder3D, HunyuanVideoCoderLayout
from diffserve.models.vaes.tiling import StridedTilingMixin, blend_t, per_sample

DOWN_BLOCK = "HunyuanVideoDownBlock3D"
UP_BLOCK = "HunyuanVideoUpBlock3D"

#: Diffusers' `AutoencoderKLHunyuanVideo` config keys and defaults (those of the released VAE).
HUNYUAN_VIDEO_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "down_block_types": (DOWN_BLOCK,) * 4,
    "up_block_types": (UP_BLOCK,) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "scaling_factor": 0.476986,
    "spatial_compression_ratio": 8,
    "temporal_compression_ratio": 4,
    "mid_block_add_attention": True,
}


class AutoencoderKLHunyuanVideo(HunyuanVideoVaeShapes, DiffusersConfigured, StridedTilingMixin, nn.Module):
    """HunyuanVideo's causal video VAE with Diffusers' config keys and weight names."""

    diffusers_class_name: ClassVar[str] = "AutoencoderKLHunyuanVideo"
    config_defaults = HUNYUAN_VIDEO_VAE_CONFIG_DEFAULTS

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 3,
        latent_channels: int = 16,
        down_block_types: Sequence[str] = (DOWN_BLOCK,) * 4,
        up_block_types: Sequence[str] = (UP_BLOCK,) * 4,
        block_out_channels: Sequence[int] = (128, 256, 512, 512),
        layers_per_block: int = 2,
        act_fn: str = "silu",
        norm_num_groups: int = 32,
        scaling_factor: float = 0.476986,
        spatial_compression_ratio: int = 8,
        temporal_compression_ratio: int = 4,
        mid_block_add_attention: bool = True,
    ) -> None:
        super().__init__()
        levels = len(block_out_channels)
        if tuple(down_block_types) != (DOWN_BLOCK,) * levels or tuple(up_block_types) != (UP_BLOCK,) * levels:
            raise ValueError(
                f"HunyuanVideo VAE: only {DOWN_BLOCK} / {UP_BLOCK} blocks, one per block_out_channels entry, "
                f"are supported; got {list(down_block_types)} / {list(up_block_types)}"
            )
        if act_fn not in ("silu", "swish"):
            raise ValueError(
                f"HunyuanVideo VAE: act_fn {act_fn!r} is not supported (the released VAE uses 'silu')"
            )
        self.config: dict[str, Any] = {
            "in_channels": in_channels,
            "out_channels": out_channels,
            "latent_channels": latent_channels,
            "down_block_types": tuple(down_block_types),
            "up_block_types": tuple(up_block_types),
            "block_out_channels": tuple(block_out_channels),
            "layers_per_block": layers_per_block,
            "act_fn": act_fn,
            "norm_num_groups": norm_num_groups,
            "scaling_factor": scaling_factor,
            "spatial_compression_ratio": spatial_compression_ratio,
            "temporal_compression_ratio": temporal_compression_ratio,
            "mid_block_add_attention": mid_block_add_attention,
        }
        shape = (layers_per_block, norm_num_groups, spatial_compression_ratio, temporal_compression_ratio)
        self.encoder = Encoder3D(
            HunyuanVideoCoderLayout(
                in_channels, 2 * latent_channels, block_out_channels, *shape, mid_block_add_attention
            )
        )
        self.decoder = Decoder3D(
            HunyuanVideoCoderLayout(
                latent_channels, out_channels, block_out_channels, *shape, mid_block_add_attention
            )
        )
        self.quant_conv = nn.Conv3d(2 * latent_channels, 2 * latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(latent_channels, latent_channels, 1)
        # Diffusers' tile defaults: 256-pixel tiles every 192 pixels, 16-frame chunks every 12 frames.
        self.tile_sample_min_height = 256
        self.tile_sample_min_width = 256
        self.tile_sample_stride_height = 192
        self.tile_sample_stride_width = 192
        self.tile_sample_min_num_frames = 16
        self.tile_sample_stride_num_frames = 12

    def enable_tiling(
        self,
        tile_sample_min_height: int | None = None,
        tile_sample_min_width: int | None = None,
        tile_sample_stride_height: int | None = None,
        tile_sample_stride_width: int | None = None,
        tile_sample_min_num_frames: int | None = None,
        tile_sample_stride_num_frames: int | None = None,
    ) -> None:
        """Decode / encode frames larger than a tile in overlapping spatial tiles (Diffusers' parameters, in
        pixels and frames); None keeps a parameter. The frame-chunk sizes apply with tiling on or off."""
        self._enable_tiling_with(
            tile_sample_min_height=tile_sample_min_height,
            tile_sample_min_width=tile_sample_min_width,
            tile_sample_stride_height=tile_sample_stride_height,
            tile_sample_stride_width=tile_sample_stride_width,
            tile_sample_min_num_frames=tile_sample_min_num_frames,
            tile_sample_stride_num_frames=tile_sample_stride_num_frames,
        )

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Video (B, C, 1 + 4k, H, W) in [-1, 1] -> posterior over unscaled latents (B, latent, 1 + k, H/8, W/8)."""
        self.check_video(x)
        return DiagonalGaussian.from_moments(per_sample(self._encode, x, self.use_slicing))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, latent, t, h, w) -> video (B, C, 1 + 4 (t - 1), 8h, 8w), not clamped."""
        self.check_latents(z)
        return per_sample(self._decode, z, self.use_slicing)

    def _encode_frames(self, x: torch.Tensor) -> torch.Tensor:
        """Moments of one chunk of frames, spatially tiled when tiling is on and the frame is larger."""
        run = self._encode_network
        if not self.tiles_needed(x, self.tile_sample_min_height, self.tile_sample_min_width):
            return run(x)
        ratio = self.spatial_compression_ratio
        moments = self.run_strided_tiles(run, x, 1, ratio)
        return moments[..., : x.shape[-2] // ratio, : x.shape[-1] // ratio]

    def _encode_network(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_conv(self.encoder(x))

    def _decode_frames(self, z: torch.Tensor) -> torch.Tensor:
        """Video of one chunk of latent frames, spatially tiled when tiling is on and the frame is larger."""
        ratio = self.spatial_compression_ratio
        run = self._decode_network
        if not self.tiles_needed(
            z, self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio
        ):
            return run(z)
        video = self.run_strided_tiles(partial(decode_tile, run), z, ratio, 1)
        return video[..., : z.shape[-2] * ratio, : z.shape[-1] * ratio]

    def _decode_network(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        ratio = self.temporal_compression_ratio
        frames = (x.shape[2] - 1) // ratio + 1
        tile, stride = self.tile_sample_min_num_frames, self.tile_sample_stride_num_frames
        if x.shape[2] <= tile:
            return self._encode_frames(x)
        return _chunked(
            self._encode_frames, x, tile + 1, stride, tile // ratio - stride // ratio, stride // ratio
        )[:, :, :frames]

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        ratio = self.temporal_compression_ratio
        frames = (z.shape[2] - 1) * ratio + 1
        tile, stride = self.tile_sample_min_num_frames, self.tile_sample_stride_num_frames
        if z.shape[2] <= tile // ratio:
            return self._decode_frames(z)
        decode = partial(decode_tile, self._decode_frames)
        return _chunked(decode, z, tile // ratio + 1, stride // ratio, tile - stride, stride)[:, :, :frames]


def _chunked(
    run: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    length: int,
    stride: int,
    blend: int,
    keep: int,
) -> torch.Tensor:
    """`run` on chunks of `length` frames of `x` starting every `stride` frames; every chunk after the first
    loses its first output frame and cross-fades `blend` frames with the one before; the first keeps
    `keep + 1` frames, the others `keep`. Not cropped (Diffusers' temporal tiling)."""
    outputs = []
    for i, start in enumerate(range(0, x.shape[2], stride)):
        out = run(x[:, :, start : start + length])
        outputs.append(out if i == 0 else out[:, :, 1:])
    kept = [outputs[0][:, :, : keep + 1]]
    for previous, out in zip(outputs, outputs[1:], strict=False):
        kept.append(blend_t(previous, out, blend)[:, :, :keep])
    return torch.cat(kept, dim=2)
