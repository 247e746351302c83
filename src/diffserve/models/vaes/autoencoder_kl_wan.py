"""Diffusers' `AutoencoderKLWan`: Wan's video VAE, in the Wan 2.1 layout or the Wan 2.2 one.

The network is the shared causal 3-D VAE (`causal3d_blocks.CausalVideoVAE`, which Qwen-Image's VAE
also uses); this class maps Wan's config keys onto it. Wan 2.2's VAE (TI2V-5B: z_dim 48, 16x spatial
compression) sets `is_residual` (parameter-free space-time/channel shortcuts around each level, width-
keeping upsamplers) and `patch_size` 2 (2x2 pixel cells folded into 12 input channels). State-dict keys
match Diffusers', so checkpoints load with `strict=True` into a model built on the meta device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.causal3d_blocks import LATENTS_MEAN, LATENTS_STD, CausalVideoVAE

#: Diffusers' `AutoencoderKLWan` config keys and defaults (Wan 2.1's VAE; Wan 2.2's sets `is_residual`,
#: `patch_size`, its own widths, channels and latent statistics).
WAN_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "base_dim": 96,
    "decoder_base_dim": None,
    "z_dim": 16,
    "dim_mult": (1, 2, 4, 4),
    "num_res_blocks": 2,
    "attn_scales": (),
    "temperal_downsample": (False, True, True),
    "dropout": 0.0,
    "latents_mean": LATENTS_MEAN,
    "latents_std": LATENTS_STD,
    "is_residual": False,
    "in_channels": 3,
    "out_channels": 3,
    "patch_size": None,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}


class AutoencoderKLWan(DiffusersConfigured, CausalVideoVAE):
    """Wan's video VAE with Diffusers' `AutoencoderKLWan` config keys: Wan 2.1's (the same network as
    Qwen-Image's) or, with `is_residual` and `patch_size`, Wan 2.2's.

    `scale_factor_temporal` / `scale_factor_spatial` are kept in `config` for pipelines that read them;
    the compression-ratio properties are derived from the network itself (patch size included).
    """

    diffusers_class_name: ClassVar[str] = "AutoencoderKLWan"
    config_defaults = WAN_VAE_CONFIG_DEFAULTS

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
        latents_mean: Sequence[float] = LATENTS_MEAN,
        latents_std: Sequence[float] = LATENTS_STD,
        is_residual: bool = False,
        in_channels: int = 3,
        out_channels: int = 3,
        patch_size: int | None = None,
        scale_factor_temporal: int | None = 4,
        scale_factor_spatial: int | None = 8,
    ) -> None:
        if patch_size is not None and patch_size < 1:
            raise ValueError(f"AutoencoderKLWan: patch_size must be None or >= 1, got {patch_size}")
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
            residual=is_residual,
            patch_size=None if patch_size in (None, 1) else patch_size,
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
