"""Diffusers' `AutoencoderKLHunyuanVideo15`: HunyuanVideo-1.5's video VAE (32 latent channels, 16x spatial
and 4x temporal compression).

    encode: video (B, 3, 1 + 4k, 16H, 16W) in [-1, 1] -> DiagonalGaussian over (B, 32, 1 + k, H, W)
    decode: latents (B, 32, 1 + k, H, W) -> video (B, 3, 1 + 4k, 16H, 16W), roughly in [-1, 1]

As in Diffusers, the encoder takes the whole clip at once, there are no quant / post-quant convs, the
decoded video is not clamped (the pipeline's post-processing clamps), and the latent scaling
(`latents * scaling_factor` after encoding, `/ scaling_factor` before decoding) is the pipeline's job:
`scaling_factor` is kept in `config`. There are no latent mean / std statistics.

The untiled decode runs the clip a latent frame at a time (`_decode_frames`: the first latent frame alone,
then `DECODE_CHUNK_LATENT_FRAMES` at a time) with a causal cache, which gives Diffusers' one-pass frames
(the decoder is causal in time: `hunyuan_video15_blocks.py`; equal up to fp32 rounding, as the convs run
on fewer frames at once) while only one chunk's activations are alive. Each chunk is a decode chunk
(`decode_chunk_boundary` before it) and, for a streamed job (`decode_output_wanted`), its pixels are
handed out as soon as they exist (`decode_chunk_output`). `decode_whole_clip` is Diffusers' one-pass
decode, kept as the reference of the tests and timings.

Tiling (`enable_tiling`, Diffusers' parameters and defaults) cuts the frame into spatial tiles (all frames
of a tile at once, no temporal tiling) and blends them with `tiling.stitch_tiles`, exactly as Diffusers'
class does; slicing encodes / decodes a batch one element at a time. The network is in
`hunyuan_video15_blocks.py`; state-dict keys match Diffusers', so checkpoints load with `strict=True` into
a model built on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.causal3d_blocks import CausalCache
from diffserve.models.vaes.hunyuan_video15_blocks import Decoder3D, Encoder3D, HunyuanVideo15CoderLayout
from diffserve.models.vaes.tiling import TilingMixin, decode_chunk_boundary, per_sample, run_overlapping_tiles
from diffserve.vae_tiling import decode_chunk_output, decode_output_wanted

#: Latent frames per chunk of the untiled decode after the first latent frame (decoded alone, so a streamed
#: job's first frame comes out first). One latent frame (4 video frames) keeps the decoder's activations at
#: one latent frame's, what the engine's memory model counts for a video VAE (`runtime/memory.py`); measured
#: on the CPU, it decodes about as fast as one pass where the convs are wide enough for oneDNN (the
#: released widths) and holds a fraction of its memory.
DECODE_CHUNK_LATENT_FRAMES = 1

#: Diffusers' `AutoencoderKLHunyuanVideo15` config keys and defaults (those of the released VAE).
HUNYUAN_VIDEO15_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 32,
    "block_out_channels": (128, 256, 512, 1024, 1024),
    "layers_per_block": 2,
    "spatial_compression_ratio": 16,
    "temporal_compression_ratio": 4,
    "downsample_match_channel": True,
    "upsample_match_channel": True,
    "scaling_factor": 1.03682,
}


class HunyuanVideoVaeShapes:
    """What the HunyuanVideo VAEs (1.0's and 1.5's) state alike: the compression ratios their configs hold
    and the checks of `encode`'s videos and `decode`'s latents."""

    config: Mapping[str, Any]

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (8 for 1.0's released VAE, 16 for 1.5's)."""
        return self.config["spatial_compression_ratio"]

    @property
    def temporal_compression_ratio(self) -> int:
        """Frames per latent frame after the first (4 for the released VAEs): T = 1 + ratio * (t - 1)."""
        return self.config["temporal_compression_ratio"]

    @staticmethod
    def check_video(x: torch.Tensor) -> None:
        if x.ndim != 5:
            raise ValueError(f"expected a video batch (B, C, T, H, W), got shape {tuple(x.shape)}")

    @staticmethod
    def check_latents(z: torch.Tensor) -> None:
        if z.ndim != 5:
            raise ValueError(f"expected video latents (B, C, t, h, w), got shape {tuple(z.shape)}")


class AutoencoderKLHunyuanVideo15(HunyuanVideoVaeShapes, DiffusersConfigured, TilingMixin, nn.Module):
    """HunyuanVideo-1.5's causal video VAE with Diffusers' config keys and weight names."""

    diffusers_class_name: ClassVar[str] = "AutoencoderKLHunyuanVideo15"
    config_defaults = HUNYUAN_VIDEO15_VAE_CONFIG_DEFAULTS

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 3,
        latent_channels: int = 32,
        block_out_channels: Sequence[int] = (128, 256, 512, 1024, 1024),
        layers_per_block: int = 2,
        spatial_compression_ratio: int = 16,
        temporal_compression_ratio: int = 4,
        downsample_match_channel: bool = True,
        upsample_match_channel: bool = True,
        scaling_factor: float = 1.03682,
    ) -> None:
        super().__init__()
        self.config: dict[str, Any] = {
            "in_channels": in_channels,
            "out_channels": out_channels,
            "latent_channels": latent_channels,
            "block_out_channels": tuple(block_out_channels),
            "layers_per_block": layers_per_block,
            "spatial_compression_ratio": spatial_compression_ratio,
            "temporal_compression_ratio": temporal_compression_ratio,
            "downsample_match_channel": downsample_match_channel,
            "upsample_match_channel": upsample_match_channel,
            "scaling_factor": scaling_factor,
        }
        ratios = (spatial_compression_ratio, temporal_compression_ratio)
        self.encoder = Encoder3D(
            HunyuanVideo15CoderLayout(
                in_channels,
                2 * latent_channels,
                block_out_channels,
                layers_per_block,
                *ratios,
                downsample_match_channel,
            )
        )
        self.decoder = Decoder3D(
            HunyuanVideo15CoderLayout(
                latent_channels,
                out_channels,
                tuple(reversed(block_out_channels)),
                layers_per_block,
                *ratios,
                upsample_match_channel,
            )
        )
        # Diffusers' tile defaults: 256-pixel tiles (16 latents at 16x), a quarter of each tile overlapping.
        # The latent sizes are not derived from the pixel ones again when `enable_tiling` changes them.
        self.tile_sample_min_height = 256
        self.tile_sample_min_width = 256
        self.tile_latent_min_height = self.tile_sample_min_height // spatial_compression_ratio
        self.tile_latent_min_width = self.tile_sample_min_width // spatial_compression_ratio
        self.tile_overlap_factor = 0.25

    def enable_tiling(
        self,
        tile_sample_min_height: int | None = None,
        tile_sample_min_width: int | None = None,
        tile_latent_min_height: int | None = None,
        tile_latent_min_width: int | None = None,
        tile_overlap_factor: float | None = None,
    ) -> None:
        """Encode / decode frames larger than a tile in overlapping spatial tiles; None keeps a parameter.

        A frame is tiled when it is larger than `tile_sample_min_*` pixels (encode) or `tile_latent_min_*`
        latents (decode) along either side. Tiles start every `min * (1 - tile_overlap_factor)` input
        units; `min * tile_overlap_factor` output units of neighbouring tiles are cross-faded.
        """
        sizes = {
            "tile_sample_min_height": tile_sample_min_height,
            "tile_sample_min_width": tile_sample_min_width,
            "tile_latent_min_height": tile_latent_min_height,
            "tile_latent_min_width": tile_latent_min_width,
        }
        for name, value in sizes.items():
            if value is not None and value < 1:
                raise ValueError(
                    f"{self.diffusers_class_name}.enable_tiling: {name} must be >= 1, got {value}"
                )
        self._check_overlap_factor(tile_overlap_factor)
        self._enable_tiling_with(**sizes, tile_overlap_factor=tile_overlap_factor)

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Video (B, C, 1 + r_t*k, H, W) in [-1, 1] -> posterior over unscaled latents (B, latent, 1 + k, H/r_s, W/r_s).

        H and W must be multiples of `spatial_compression_ratio` (those of every tile, when tiled).
        """
        self.check_video(x)
        sample, latent = self._tile_sizes()
        run = partial(self._run, self.encoder, tile=sample, out_tile=latent)
        return DiagonalGaussian.from_moments(per_sample(run, x, self.use_slicing))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, latent, t, h, w) -> video (B, C, 1 + r_t*(t - 1), r_s*h, r_s*w), not clamped.

        Untiled, the clip is decoded in chunks of latent frames (`_decode_frames`), one pass's frames up to
        fp32 rounding; tiled, each tile in one pass, as Diffusers does.
        """
        self.check_latents(z)
        return per_sample(self._decode_clip, z, self.use_slicing)

    def decode_whole_clip(self, z: torch.Tensor) -> torch.Tensor:
        """`decode` with every untiled clip (or batch element, sliced) through the decoder in one pass, as
        Diffusers runs it: the reference the frame-chunked decode is held to, and its timings."""
        self.check_latents(z)
        sample, latent = self._tile_sizes()
        return per_sample(partial(self._run, self.decoder, tile=latent, out_tile=sample), z, self.use_slicing)

    def _decode_clip(self, z: torch.Tensor) -> torch.Tensor:
        """One clip (or a batch decoded together): spatial tiles in one pass each when tiling applies,
        else frame-chunked, each chunk handed out for a streamed job."""
        sample, latent = self._tile_sizes()
        if self.tiles_needed(z, *latent):
            return self._run(self.decoder, z, latent, sample)
        return self._decode_frames(z)

    def _decode_frames(self, z: torch.Tensor) -> torch.Tensor:
        """The decoder over `z`'s latent frames chunk by chunk (`latent_chunks`) with one causal cache: the
        one-pass decode's frames (to fp32 rounding). Each chunk is a decode chunk (`decode_chunk_boundary` before it);
        for a streamed job its pixels, clamped to [-1, 1], are handed out (`decode_chunk_output`) before
        the next chunk decodes. The chunks are written into one preallocated video (no final concat)."""
        cache = CausalCache()
        publish = decode_output_wanted()
        video: torch.Tensor | None = None
        start = 0
        for chunk in latent_chunks(z.shape[2], DECODE_CHUNK_LATENT_FRAMES):
            decode_chunk_boundary()
            pixels = self.decoder(z[:, :, chunk], cache)
            if video is None:
                frames = 1 + self.temporal_compression_ratio * (z.shape[2] - 1)
                video = pixels.new_empty((*pixels.shape[:2], frames, *pixels.shape[3:]))
            video[:, :, start : start + pixels.shape[2]] = pixels
            start += pixels.shape[2]
            if publish:
                decode_chunk_output(pixels.clamp(-1.0, 1.0))
            del pixels
        assert video is not None and start == video.shape[2]
        return video

    def _tile_sizes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(height, width) of a tile in pixels and in latents."""
        return (
            (self.tile_sample_min_height, self.tile_sample_min_width),
            (self.tile_latent_min_height, self.tile_latent_min_width),
        )

    def _run(
        self, network: nn.Module, x: torch.Tensor, tile: tuple[int, int], out_tile: tuple[int, int]
    ) -> torch.Tensor:
        """`network` (the encoder or the decoder) on `x`, or with tiling on and `x` larger than `tile`, on
        overlapping spatial tiles stitched as Diffusers does (`tiling.py`), each tile a decode chunk
        (`decode_chunk_boundary` before it; nothing when encoding)."""
        if not self.tiles_needed(x, *tile):
            return network(x)
        return run_overlapping_tiles(
            partial(decode_tile, network), x, tile, out_tile, self.tile_overlap_factor
        )


def latent_chunks(frames: int, per_chunk: int) -> list[slice]:
    """The chunks of a frame-chunked decode of `frames` latent frames: the first frame alone (one video
    frame, out as early as possible), then `per_chunk` frames at a time (the last may be shorter)."""
    if frames < 1 or per_chunk < 1:
        raise ValueError(f"cannot chunk {frames} latent frames {per_chunk} at a time")
    return [slice(0, 1)] + [slice(i, min(i + per_chunk, frames)) for i in range(1, frames, per_chunk)]


def decode_tile(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`run(x)` as one decode chunk (`decode_chunk_boundary` first): a tile or a chunk of frames."""
    decode_chunk_boundary()
    return run(x)
