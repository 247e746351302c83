"""Causal 3-D convolutional KL autoencoder: Diffusers' `AutoencoderKLQwenImage` and `AutoencoderKLWan` (Wan 2.1).

Qwen-Image's VAE is a fine-tune of the Wan 2.1 video VAE; the network is the same, only the
Diffusers class name and config keys differ. Architecture (building blocks in `causal3d_blocks`):

    encode: video (B, 3, T, H, W) in [-1, 1]
        -> Encoder3d, run on frame 0 alone, then on chunks of 4 frames      (causal convs carry a cache)
        -> quant_conv (1x1x1)  -> DiagonalGaussian over (B, z_dim, 1 + (T - 1) / 4, H / 8, W / 8)
    decode: latents (B, z_dim, t, h, w)
        -> post_quant_conv (1x1x1) -> Decoder3d, run one latent frame at a time
        -> clamp to [-1, 1]    -> video (B, 3, 1 + (t - 1) * 4, h * 8, w * 8)

(/4 and /8 for the released config: three downsamplings, the last two also temporal.) Images are
single-frame videos (T = 1), which is how Qwen-Image uses it. The chunking is the one Diffusers
uses, so results match it, and memory stays bounded by the chunk size rather than the clip length.
As in Diffusers, trailing frames that do not complete a chunk of 4 are not encoded: pass 1 + 4k frames.

The latent normalisation ((z - latents_mean) / latents_std) is the pipeline's job, as in Diffusers;
the config's values are exposed as `latents_mean` / `latents_std`. Tiling and slicing are not
implemented. State-dict keys match Diffusers', so checkpoints load with `strict=True` into a model
built on the meta device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.models.config_keys import checked_config_kwargs
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.causal3d_blocks import CausalCache, CausalConv3d, Decoder3d, Encoder3d

#: Per-channel latent statistics of the released Qwen-Image / Wan 2.1 VAEs (Diffusers' defaults).
_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

#: Diffusers' `AutoencoderKLQwenImage` config keys and defaults (the released Qwen-Image VAE uses these).
#: `temperal_downsample` keeps Diffusers' spelling; `dropout` is accepted and unused (inference only).
QWEN_IMAGE_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": (1, 2, 4, 4),
    "num_res_blocks": 2,
    "attn_scales": (),
    "temperal_downsample": (False, True, True),
    "dropout": 0.0,
    "input_channels": 3,
    "latents_mean": _LATENTS_MEAN,
    "latents_std": _LATENTS_STD,
}

#: Diffusers' `AutoencoderKLWan` config keys and defaults (Wan 2.1's VAE). The Wan 2.2 variant
#: (`is_residual`, `patch_size`) is a different network and is rejected.
WAN_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "base_dim": 96,
    "decoder_base_dim": None,
    "z_dim": 16,
    "dim_mult": (1, 2, 4, 4),
    "num_res_blocks": 2,
    "attn_scales": (),
    "temperal_downsample": (False, True, True),
    "dropout": 0.0,
    "latents_mean": _LATENTS_MEAN,
    "latents_std": _LATENTS_STD,
    "is_residual": False,
    "in_channels": 3,
    "out_channels": 3,
    "patch_size": None,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}

#: Encoder chunk length after the first frame: two temporal downsamplings turn 4 frames into 1 latent.
ENCODE_CHUNK_FRAMES = 4


class CausalVideoVAE(nn.Module):
    """The Wan 2.1 network; subclasses map their Diffusers config onto it and set `config`."""

    config: dict[str, Any]

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

        self.encoder = Encoder3d(
            in_channels,
            2 * z_dim,
            encoder_dim,
            dim_mult,
            num_res_blocks,
            attn_scales,
            temporal_downsample,
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
        )

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (8 for the released VAEs)."""
        return 2**self._spatial_downsamplings

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
        cache = CausalCache()
        n = ENCODE_CHUNK_FRAMES
        chunks = [x[:, :, :1]]
        chunks += [x[:, :, 1 + n * i : 1 + n * (i + 1)] for i in range((x.shape[2] - 1) // n)]
        moments = torch.cat([self.encoder(chunk, cache) for chunk in chunks], dim=2)
        return DiagonalGaussian.from_moments(self.quant_conv(moments))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unnormalised latents (B, z_dim, t, h, w) -> video (B, C, 1 + 4 (t - 1), 8h, 8w) clamped to [-1, 1]."""
        if z.ndim != 5:
            raise ValueError(f"expected video latents (B, z_dim, t, h, w), got shape {tuple(z.shape)}")
        cache = CausalCache()
        x = self.post_quant_conv(z)
        frames = [self.decoder(x[:, :, i : i + 1], cache) for i in range(x.shape[2])]
        return torch.cat(frames, dim=2).clamp_(-1.0, 1.0)


class AutoencoderKLQwenImage(CausalVideoVAE):
    """Qwen-Image's VAE with Diffusers' config keys and state-dict names.

    Build it with keyword config values (or `from_config(config_json_dict)`); under
    `torch.device("meta")` it allocates nothing, and `load_state_dict(sd, assign=True, strict=True)` fills it.
    """

    diffusers_class_name: ClassVar[str] = "AutoencoderKLQwenImage"

    def __init__(
        self,
        base_dim: int = 96,
        z_dim: int = 16,
        dim_mult: Sequence[int] = (1, 2, 4, 4),
        num_res_blocks: int = 2,
        attn_scales: Sequence[float] = (),
        temperal_downsample: Sequence[bool] = (False, True, True),
        dropout: float = 0.0,
        input_channels: int = 3,
        latents_mean: Sequence[float] = _LATENTS_MEAN,
        latents_std: Sequence[float] = _LATENTS_STD,
    ) -> None:
        super().__init__(
            in_channels=input_channels,
            out_channels=input_channels,
            encoder_dim=base_dim,
            decoder_dim=base_dim,
            z_dim=z_dim,
            dim_mult=dim_mult,
            num_res_blocks=num_res_blocks,
            attn_scales=attn_scales,
            temporal_downsample=temperal_downsample,
            latents_mean=latents_mean,
            latents_std=latents_std,
        )
        self.config = {
            "base_dim": base_dim,
            "z_dim": z_dim,
            "dim_mult": tuple(dim_mult),
            "num_res_blocks": num_res_blocks,
            "attn_scales": tuple(attn_scales),
            "temperal_downsample": tuple(bool(t) for t in temperal_downsample),
            "dropout": dropout,
            "input_channels": input_channels,
            "latents_mean": tuple(latents_mean),
            "latents_std": tuple(latents_std),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AutoencoderKLQwenImage:
        """Build from a Diffusers `config.json` dict; `_`-prefixed metadata keys are ignored, unknown keys are an error."""
        return cls(**checked_config_kwargs(config, QWEN_IMAGE_VAE_CONFIG_DEFAULTS, cls.diffusers_class_name))


class AutoencoderKLWan(CausalVideoVAE):
    """Wan 2.1's video VAE (the same network as Qwen-Image's) with Diffusers' `AutoencoderKLWan` config keys.

    Only the Wan 2.1 layout is supported: `is_residual=True` / `patch_size` (Wan 2.2's VAE) raise.
    `scale_factor_temporal` / `scale_factor_spatial` are kept in `config` for pipelines that read them;
    the compression-ratio properties are derived from the network itself.
    """

    diffusers_class_name: ClassVar[str] = "AutoencoderKLWan"

    def __init__(
        self,
        base_dim: int = 96,
        decoder_base_dim: int | None = None,
        z_dim: int = 16,
        dim_mult: Sequence[int] = (1, 2, 4, 4),
        num_res_blocks: int = 2,
        attn_scales: Sequence[float] = (),
        temperal_downsample: Sequence[bool] = (False, True, True),
        dropout: float = 0.0,
        latents_mean: Sequence[float] = _LATENTS_MEAN,
        latents_std: Sequence[float] = _LATENTS_STD,
        is_residual: bool = False,
        in_channels: int = 3,
        out_channels: int = 3,
        patch_size: int | None = None,
        scale_factor_temporal: int | None = 4,
        scale_factor_spatial: int | None = 8,
    ) -> None:
        if is_residual or patch_size is not None:
            raise ValueError(
                "AutoencoderKLWan: only the Wan 2.1 VAE is supported; this config is the Wan 2.2 "
                f"variant (is_residual={is_residual}, patch_size={patch_size})"
            )
        super().__init__(
            in_channels=in_channels,
            out_channels=out_channels,
            encoder_dim=base_dim,
            decoder_dim=base_dim if decoder_base_dim is None else decoder_base_dim,
            z_dim=z_dim,
            dim_mult=dim_mult,
            num_res_blocks=num_res_blocks,
            attn_scales=attn_scales,
            temporal_downsample=temperal_downsample,
            latents_mean=latents_mean,
            latents_std=latents_std,
        )
        self.config = {
            "base_dim": base_dim,
            "decoder_base_dim": decoder_base_dim,
            "z_dim": z_dim,
            "dim_mult": tuple(dim_mult),
            "num_res_blocks": num_res_blocks,
            "attn_scales": tuple(attn_scales),
            "temperal_downsample": tuple(bool(t) for t in temperal_downsample),
            "dropout": dropout,
            "latents_mean": tuple(latents_mean),
            "latents_std": tuple(latents_std),
            "is_residual": is_residual,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "patch_size": patch_size,
            "scale_factor_temporal": scale_factor_temporal,
            "scale_factor_spatial": scale_factor_spatial,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AutoencoderKLWan:
        """Build from a Diffusers `config.json` dict; `_`-prefixed metadata keys are ignored, unknown keys are an error."""
        return cls(**checked_config_kwargs(config, WAN_VAE_CONFIG_DEFAULTS, cls.diffusers_class_name))
