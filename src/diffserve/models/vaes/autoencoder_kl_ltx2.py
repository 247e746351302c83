"""Native LTX-2 video VAE: Diffusers' `AutoencoderKLLTX2Video`.

    encode: video (B, 3, 1 + 8k, H, W) in [-1, 1] -> DiagonalGaussian over (B, 128, 1 + k, H/32, W/32)
    decode: latents (B, 128, t, h, w) [, decode timestep (B,)] -> video (B, 3, 1 + 8 (t - 1), 32 h, 32 w)

(/32 and /8 for the released config.) The network is in `ltx2_video_blocks.py`. As in Diffusers, the
latent normalisation ((z - latents_mean) * scaling_factor / latents_std) is the pipeline's job; the
statistics are the `latents_mean` / `latents_std` buffers (state-dict keys, loaded with the weights)
and `scaling_factor` is in `config`. The decoder output is not clamped.

Causality: `encode(causal=...)` / `decode(causal=...)` follow Diffusers' rule `causal or config flag`,
so an explicit False cannot make a causal encoder/decoder non-causal.

Memory-saving modes, with Diffusers' attribute names, defaults and numerics (the shared machinery is
`tiling.py`):
  * `use_slicing` (`enable_slicing()`): one batch item at a time. With a decode timestep, each item gets
    its own (Diffusers' sliced decode pairs them wrongly there; unsliced results are the reference).
  * `use_tiling` (`enable_tiling(...)`): spatial tiles of `tile_sample_min_height` x `..._width` pixels
    every `tile_sample_stride_*` pixels, overlaps cross-faded, when the input is larger than one tile.
  * `use_framewise_decoding`: temporal tiles of `tile_sample_min_num_frames` (+1) frames every
    `tile_sample_stride_num_frames`, cross-faded in time, spatially tiled too when `use_tiling`. As in
    Diffusers, this one flag switches temporal tiling for both decode *and encode*;
    `use_framewise_encoding` is kept for attribute parity and, as in Diffusers, switches nothing.
    Diffusers' temporal decode cross-fades two tiles one frame out of line (a tile's first frame is the
    previous tile's last latent frame, but it is faded against the frame after it); kept, for parity.
State-dict keys match Diffusers', so a checkpoint loads with `strict=True` into a meta-built model.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured, check_choices, per_block
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.ltx2_video_blocks import (
    DOWNSAMPLE_STRIDES,
    SPATIAL_PADDING_MODES,
    UPSAMPLE_STRIDES,
    LTX2VideoDecoder3d,
    LTX2VideoEncoder3d,
)
from diffserve.models.vaes.tiling import (
    StridedTilingMixin,
    blend_t,
    decode_chunk_boundary,
    per_sample,
    tile_starts,
)

#: Diffusers' `AutoencoderKLLTX2Video.__init__` keys and defaults (the released LTX-2 config overrides
#: `decoder_causal` (False) and the two compression ratios (32, 8)).
LTX2_VIDEO_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 128,
    "block_out_channels": (256, 512, 1024, 2048),
    "down_block_types": ("LTX2VideoDownBlock3D",) * 4,
    "decoder_block_out_channels": (256, 512, 1024),
    "layers_per_block": (4, 6, 6, 2, 2),
    "decoder_layers_per_block": (5, 5, 5, 5),
    "spatio_temporal_scaling": (True, True, True, True),
    "decoder_spatio_temporal_scaling": (True, True, True),
    "decoder_inject_noise": (False, False, False, False),
    "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    "upsample_type": ("spatiotemporal", "spatiotemporal", "spatiotemporal"),
    "upsample_residual": (True, True, True),
    "upsample_factor": (2, 2, 2),
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "scaling_factor": 1.0,
    "encoder_causal": True,
    "decoder_causal": True,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": None,
    "temporal_compression_ratio": None,
}

#: Diffusers' tiling defaults for this class (pixels / frames).
TILE_DEFAULTS: dict[str, int] = {
    "tile_sample_min_height": 512,
    "tile_sample_min_width": 512,
    "tile_sample_min_num_frames": 16,
    "tile_sample_stride_height": 448,
    "tile_sample_stride_width": 448,
    "tile_sample_stride_num_frames": 8,
}


class AutoencoderKLLTX2Video(DiffusersConfigured, StridedTilingMixin, nn.Module):
    """LTX-2's video VAE with Diffusers' config keys, weight names and tiling/slicing modes."""

    diffusers_class_name: ClassVar[str] = "AutoencoderKLLTX2Video"
    config_defaults = LTX2_VIDEO_VAE_CONFIG_DEFAULTS

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 3,
        latent_channels: int = 128,
        block_out_channels: Sequence[int] = (256, 512, 1024, 2048),
        down_block_types: Sequence[str] = ("LTX2VideoDownBlock3D",) * 4,
        decoder_block_out_channels: Sequence[int] = (256, 512, 1024),
        layers_per_block: Sequence[int] = (4, 6, 6, 2, 2),
        decoder_layers_per_block: Sequence[int] = (5, 5, 5, 5),
        spatio_temporal_scaling: bool | Sequence[bool] = (True, True, True, True),
        decoder_spatio_temporal_scaling: bool | Sequence[bool] = (True, True, True),
        decoder_inject_noise: bool | Sequence[bool] = (False, False, False, False),
        downsample_type: Sequence[str] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type: Sequence[str] = ("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual: bool | Sequence[bool] = (True, True, True),
        upsample_factor: Sequence[int] = (2, 2, 2),
        timestep_conditioning: bool = False,
        patch_size: int = 4,
        patch_size_t: int = 1,
        resnet_norm_eps: float = 1e-6,
        scaling_factor: float = 1.0,
        encoder_causal: bool = True,
        decoder_causal: bool = True,
        encoder_spatial_padding_mode: str = "zeros",
        decoder_spatial_padding_mode: str = "reflect",
        spatial_compression_ratio: int | None = None,
        temporal_compression_ratio: int | None = None,
    ) -> None:
        super().__init__()
        self.config: dict[str, Any] = {
            "in_channels": in_channels,
            "out_channels": out_channels,
            "latent_channels": latent_channels,
            "block_out_channels": tuple(block_out_channels),
            "down_block_types": tuple(down_block_types),
            "decoder_block_out_channels": tuple(decoder_block_out_channels),
            "layers_per_block": tuple(layers_per_block),
            "decoder_layers_per_block": tuple(decoder_layers_per_block),
            "spatio_temporal_scaling": _as_config(spatio_temporal_scaling),
            "decoder_spatio_temporal_scaling": _as_config(decoder_spatio_temporal_scaling),
            "decoder_inject_noise": _as_config(decoder_inject_noise),
            "downsample_type": tuple(downsample_type),
            "upsample_type": tuple(upsample_type),
            "upsample_residual": _as_config(upsample_residual),
            "upsample_factor": tuple(upsample_factor),
            "timestep_conditioning": timestep_conditioning,
            "patch_size": patch_size,
            "patch_size_t": patch_size_t,
            "resnet_norm_eps": resnet_norm_eps,
            "scaling_factor": scaling_factor,
            "encoder_causal": encoder_causal,
            "decoder_causal": decoder_causal,
            "encoder_spatial_padding_mode": encoder_spatial_padding_mode,
            "decoder_spatial_padding_mode": decoder_spatial_padding_mode,
            "spatial_compression_ratio": spatial_compression_ratio,
            "temporal_compression_ratio": temporal_compression_ratio,
        }
        if patch_size_t != 1:
            # Diffusers' encoder/decoder widths ignore patch_size_t, so only 1 runs there either.
            raise ValueError(f"AutoencoderKLLTX2Video: patch_size_t must be 1, got {patch_size_t}")
        owner = self.diffusers_class_name
        n_enc = len(block_out_channels)
        n_dec = len(decoder_block_out_channels)
        enc_scaling = per_block(owner, "spatio_temporal_scaling", spatio_temporal_scaling, n_enc)
        dec_scaling = per_block(
            owner, "decoder_spatio_temporal_scaling", decoder_spatio_temporal_scaling, n_dec
        )
        per_block(owner, "layers_per_block", layers_per_block, n_enc + 1)
        per_block(owner, "decoder_layers_per_block", decoder_layers_per_block, n_dec + 1)
        down_types = per_block(owner, "down_block_types", down_block_types, n_enc)
        check_choices(owner, "down_block_types", down_types, ["LTX2VideoDownBlock3D"])
        downsample_types = per_block(owner, "downsample_type", downsample_type, n_enc)
        check_choices(owner, "downsample_type", downsample_types, DOWNSAMPLE_STRIDES)
        check_choices(
            owner, "upsample_type", per_block(owner, "upsample_type", upsample_type, n_dec), UPSAMPLE_STRIDES
        )
        per_block(owner, "upsample_factor", upsample_factor, n_dec)
        for name, mode in (
            ("encoder_spatial_padding_mode", encoder_spatial_padding_mode),
            ("decoder_spatial_padding_mode", decoder_spatial_padding_mode),
        ):
            check_choices(owner, name, [mode], SPATIAL_PADDING_MODES)

        self.encoder = LTX2VideoEncoder3d(
            in_channels=in_channels,
            latent_channels=latent_channels,
            block_out_channels=block_out_channels,
            spatio_temporal_scaling=enc_scaling,
            layers_per_block=layers_per_block,
            downsample_type=downsample_type,
            patch_size=patch_size,
            eps=resnet_norm_eps,
            is_causal=encoder_causal,
            spatial_padding_mode=encoder_spatial_padding_mode,
        )
        self.decoder = LTX2VideoDecoder3d(
            latent_channels=latent_channels,
            out_channels=out_channels,
            block_out_channels=decoder_block_out_channels,
            spatio_temporal_scaling=dec_scaling,
            layers_per_block=decoder_layers_per_block,
            upsample_type=upsample_type,
            patch_size=patch_size,
            eps=resnet_norm_eps,
            is_causal=decoder_causal,
            inject_noise=per_block(owner, "decoder_inject_noise", decoder_inject_noise, n_dec + 1),
            timestep_conditioning=timestep_conditioning,
            upsample_residual=per_block(owner, "upsample_residual", upsample_residual, n_dec),
            upsample_factor=upsample_factor,
            spatial_padding_mode=decoder_spatial_padding_mode,
        )
        self.register_buffer("latents_mean", torch.zeros(latent_channels), persistent=True)
        self.register_buffer("latents_std", torch.ones(latent_channels), persistent=True)

        # Diffusers derives both defaults from the *encoder's* scaling count (the released config sets
        # them explicitly, since its spatial-only / temporal-only levels make that count wrong).
        levels = sum(bool(s) for s in enc_scaling)
        self.spatial_compression_ratio: int = (
            patch_size * 2**levels if spatial_compression_ratio is None else spatial_compression_ratio
        )
        self.temporal_compression_ratio: int = (
            patch_size_t * 2**levels if temporal_compression_ratio is None else temporal_compression_ratio
        )

        self.use_framewise_encoding = False
        self.use_framewise_decoding = False
        self.tile_sample_min_height = TILE_DEFAULTS["tile_sample_min_height"]
        self.tile_sample_min_width = TILE_DEFAULTS["tile_sample_min_width"]
        self.tile_sample_min_num_frames = TILE_DEFAULTS["tile_sample_min_num_frames"]
        self.tile_sample_stride_height = TILE_DEFAULTS["tile_sample_stride_height"]
        self.tile_sample_stride_width = TILE_DEFAULTS["tile_sample_stride_width"]
        self.tile_sample_stride_num_frames = TILE_DEFAULTS["tile_sample_stride_num_frames"]

    # ---- modes ----------------------------------------------------------------------------------

    def enable_tiling(
        self,
        tile_sample_min_height: int | None = None,
        tile_sample_min_width: int | None = None,
        tile_sample_min_num_frames: int | None = None,
        tile_sample_stride_height: int | None = None,
        tile_sample_stride_width: int | None = None,
        tile_sample_stride_num_frames: int | None = None,
    ) -> None:
        """Switch spatial tiling on; a None (or 0, as in Diffusers) keeps that parameter's current value.

        The num_frames pair is used by temporal tiling (`use_framewise_decoding`), which this does not
        switch on (as in Diffusers).
        """
        given = {
            "tile_sample_min_height": tile_sample_min_height,
            "tile_sample_min_width": tile_sample_min_width,
            "tile_sample_min_num_frames": tile_sample_min_num_frames,
            "tile_sample_stride_height": tile_sample_stride_height,
            "tile_sample_stride_width": tile_sample_stride_width,
            "tile_sample_stride_num_frames": tile_sample_stride_num_frames,
        }
        resolved = {name: value or getattr(self, name) for name, value in given.items()}
        for name, value in resolved.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"AutoencoderKLLTX2Video.enable_tiling: {name} must be a positive int, got {value!r}"
                )
        self._enable_tiling_with(**resolved)

    # ---- encode ---------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, causal: bool | None = None) -> DiagonalGaussian:
        """Video (B, C, T, H, W) in [-1, 1] -> posterior over unnormalised latents.

        T should be 1 + 8k, H and W multiples of `spatial_compression_ratio`.
        """
        if x.ndim != 5:
            raise ValueError(f"expected a video batch (B, C, T, H, W), got shape {tuple(x.shape)}")
        return DiagonalGaussian.from_moments(
            per_sample(lambda v: self._encode(v, causal), x, self.use_slicing)
        )

    def _encode(self, x: torch.Tensor, causal: bool | None) -> torch.Tensor:
        _, _, frames, height, width = x.shape
        # Diffusers keys temporal tiling of the encoder on `use_framewise_decoding` too.
        if self.use_framewise_decoding and frames > self.tile_sample_min_num_frames:
            return self._temporal_tiled_encode(x, causal)
        if self.tiles_needed(x, self.tile_sample_min_height, self.tile_sample_min_width):
            return self._tiled_encode(x, causal)
        return self.encoder(x, causal)

    def _tiled_encode(self, x: torch.Tensor, causal: bool | None) -> torch.Tensor:
        """Encode overlapping spatial tiles; blend their overlaps in latent space."""
        _, _, _, height, width = x.shape
        ratio = self.spatial_compression_ratio
        encode = partial(self.encoder, causal=causal)
        moments = self.run_strided_tiles(encode, x, in_scale=1, out_scale=ratio)
        return moments[:, :, :, : height // ratio, : width // ratio]

    def _temporal_tiled_encode(self, x: torch.Tensor, causal: bool | None) -> torch.Tensor:
        """Encode overlapping runs of frames (each one frame longer, for the causal first frame); blend in time."""
        _, _, frames, height, width = x.shape
        ratio_t = self.temporal_compression_ratio
        latent_frames = (frames - 1) // ratio_t + 1
        latent_stride = self.tile_sample_stride_num_frames // ratio_t
        blend = self.tile_sample_min_num_frames // ratio_t - latent_stride
        spatial = self.tiles_needed(x, self.tile_sample_min_height, self.tile_sample_min_width)
        tiles = []
        for n, start in enumerate(tile_starts(frames, self.tile_sample_stride_num_frames)):
            chunk = x[:, :, start : start + self.tile_sample_min_num_frames + 1]
            tile = self._tiled_encode(chunk, causal) if spatial else self.encoder(chunk, causal)
            tiles.append(tile[:, :, 1:] if n > 0 else tile)
        return self._stitch_time(tiles, blend, latent_stride)[:, :, :latent_frames]

    # ---- decode ---------------------------------------------------------------------------------

    def decode(
        self, z: torch.Tensor, temb: torch.Tensor | None = None, causal: bool | None = None
    ) -> torch.Tensor:
        """Unnormalised latents (B, latent, t, h, w) -> video (B, C, 1 + r_t (t - 1), r_s h, r_s w).

        `temb`: the decode timestep, one value per sample (B,), required by a timestep-conditioned
        decoder (`config["timestep_conditioning"]`) and refused by one that is not.
        """
        if z.ndim != 5:
            raise ValueError(f"expected video latents (B, C, t, h, w), got shape {tuple(z.shape)}")
        if temb is not None and not self.config["timestep_conditioning"]:
            raise ValueError(
                "this VAE's decoder is not timestep-conditioned (timestep_conditioning=False): pass temb=None"
            )
        if self.config["timestep_conditioning"] and temb is None:
            raise ValueError(
                "this VAE's decoder is timestep-conditioned: pass temb, the decode timestep per sample"
            )
        if self.use_slicing and z.shape[0] > 1:
            temb_items = temb.split(1) if temb is not None else (None,) * z.shape[0]
            outputs = []
            for zi, ti in zip(z.split(1), temb_items, strict=True):
                decode_chunk_boundary()  # each sample is a decode chunk
                outputs.append(self._decode(zi, ti, causal))
            return torch.cat(outputs)
        return self._decode(z, temb, causal)

    def _decode(self, z: torch.Tensor, temb: torch.Tensor | None, causal: bool | None) -> torch.Tensor:
        _, _, frames, height, width = z.shape
        if (
            self.use_framewise_decoding
            and frames > self.tile_sample_min_num_frames // self.temporal_compression_ratio
        ):
            return self._temporal_tiled_decode(z, temb, causal)
        if self._needs_spatial_tiles(z):
            return self._tiled_decode(z, temb, causal)
        return self.decoder(z, temb, causal)

    def _decode_chunk(self, z: torch.Tensor, temb: torch.Tensor | None, causal: bool | None) -> torch.Tensor:
        """One spatial or temporal tile through the decoder: a decode chunk (`decode_chunk_boundary`)."""
        decode_chunk_boundary()
        return self.decoder(z, temb, causal)

    def _needs_spatial_tiles(self, z: torch.Tensor) -> bool:
        """Whether tiling is on and the latents `z` are larger than one spatial tile."""
        ratio = self.spatial_compression_ratio
        return self.tiles_needed(z, self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio)

    def _tiled_decode(self, z: torch.Tensor, temb: torch.Tensor | None, causal: bool | None) -> torch.Tensor:
        """Decode overlapping latent tiles; blend their overlaps in pixel space."""
        _, _, _, height, width = z.shape
        ratio = self.spatial_compression_ratio
        tile_h, tile_w = self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio
        stride_h, stride_w = self.tile_sample_stride_height // ratio, self.tile_sample_stride_width // ratio
        if self.config["decoder_spatial_padding_mode"] == "reflect":
            for side, size, tile, stride in (
                ("height", height, tile_h, stride_h),
                ("width", width, tile_w, stride_w),
            ):
                last = min(tile, size - tile_starts(size, stride)[-1])
                if last < 2:
                    # A 1-latent edge tile cannot be reflect-padded; Diffusers fails inside the conv here.
                    raise ValueError(
                        f"tiled decode: the last tile across the latent {side} ({size}) is {last} latent wide, "
                        f"too small for the decoder's reflect padding; change tile_sample_min_{side} / "
                        f"tile_sample_stride_{side}"
                    )
        decode = partial(self._decode_chunk, temb=temb, causal=causal)
        video = self.run_strided_tiles(decode, z, in_scale=ratio, out_scale=1)
        return video[:, :, :, : height * ratio, : width * ratio]

    def _temporal_tiled_decode(
        self, z: torch.Tensor, temb: torch.Tensor | None, causal: bool | None
    ) -> torch.Tensor:
        """Decode overlapping runs of latent frames (one longer, its last output frame dropped); blend in time.

        Tile n > 0 starts at the last output frame of its first latent frame, the frame the previous tile
        already made, yet is faded against the previous tile's frames from one later on: Diffusers' layout.
        """
        _, _, frames, _, _ = z.shape
        ratio_t = self.temporal_compression_ratio
        out_frames = (frames - 1) * ratio_t + 1
        latent_tile = self.tile_sample_min_num_frames // ratio_t
        latent_stride = self.tile_sample_stride_num_frames // ratio_t
        tiles = []
        for n, start in enumerate(tile_starts(frames, latent_stride)):
            chunk = z[:, :, start : start + latent_tile + 1]
            if self._needs_spatial_tiles(chunk):
                video = self._tiled_decode(chunk, temb, causal)
            else:
                video = self._decode_chunk(chunk, temb, causal)
            tiles.append(video[:, :, :-1] if n > 0 else video)
        blend = self.tile_sample_min_num_frames - self.tile_sample_stride_num_frames
        return self._stitch_time(tiles, blend, self.tile_sample_stride_num_frames)[:, :, :out_frames]

    # ---- tile stitching -------------------------------------------------------------------------

    @staticmethod
    def _stitch_time(tiles: list[torch.Tensor], blend: int, keep: int) -> torch.Tensor:
        """Blend each temporal tile with the previous one, in place; keep `keep` frames of each (the first
        tile keeps one more: the causal first frame) and concatenate."""
        kept = []
        for n, tile in enumerate(tiles):
            if n > 0:
                kept.append(blend_t(tiles[n - 1], tile, blend)[:, :, :keep])
            else:
                kept.append(tile[:, :, : keep + 1])
        return torch.cat(kept, dim=2)


def _as_config(value: bool | Sequence[Any]) -> bool | tuple[Any, ...]:
    """A config value as Diffusers would round-trip it: a bare bool stays a bool, sequences become tuples."""
    return value if isinstance(value, bool) else tuple(value)
