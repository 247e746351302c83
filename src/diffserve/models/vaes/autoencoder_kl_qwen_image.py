"""Diffusers' `AutoencoderKLQwenImage`: Qwen-Image's VAE, a fine-tune of the Wan 2.1 video VAE.

The network is the shared causal 3-D VAE (`causal3d_blocks.CausalVideoVAE`); this class maps the
Qwen-Image config keys onto it. Images are single-frame videos (T = 1), which is how Qwen-Image uses
it. State-dict keys match Diffusers', so checkpoints load with `strict=True` into a model built on the
meta device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.causal3d_blocks import LATENTS_MEAN, LATENTS_STD, CausalVideoVAE

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
    "latents_mean": LATENTS_MEAN,
    "latents_std": LATENTS_STD,
}


class AutoencoderKLQwenImage(DiffusersConfigured, CausalVideoVAE):
    """Qwen-Image's VAE with Diffusers' config keys and state-dict names.

    Build it with keyword config values (or `from_config(config_json_dict)`); under
    `torch.device("meta")` it allocates nothing, and `load_state_dict(sd, assign=True, strict=True)` fills it.
    """

    diffusers_class_name: ClassVar[str] = "AutoencoderKLQwenImage"
    config_defaults = QWEN_IMAGE_VAE_CONFIG_DEFAULTS

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
        latents_mean: Sequence[float] = LATENTS_MEAN,
        latents_std: Sequence[float] = LATENTS_STD,
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
