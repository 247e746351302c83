"""Tiny VAE configs shared by the VAE parity tests and test_vae_tiling.py, and the weight perturbation of
the Wan-style VAEs.

A plain module (not conftest.py) so test files can import it by name."""

from __future__ import annotations

from typing import Any

import torch

from diffserve.testing.parity import perturb_parameters

#: Two KL levels (f = 2) at a tiny width: AutoencoderKL's and FLUX.2's VAE's blocks.
KL_LEVELS: dict[str, Any] = {
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
}
#: AutoencoderKL with 8 latent channels (quant convs on, Diffusers' default).
KL_TINY: dict[str, Any] = {**KL_LEVELS, "latent_channels": 8, "norm_num_groups": 16, "sample_size": 32}
#: FLUX.2's VAE: the same network, its latents patchified 2x2 and normalised by BatchNorm statistics.
FLUX2_TINY: dict[str, Any] = {**KL_TINY, "batch_norm_eps": 1e-4, "patch_size": [2, 2]}

#: Wan 2.1's layout (three downsamplings, the last two temporal) at a tiny width; Qwen-Image's VAE is the
#: same network.
WAN21_TINY: dict[str, Any] = {
    "base_dim": 16,
    "z_dim": 4,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.1, -0.2, 0.3, -0.4],
    "latents_std": [1.5, 2.0, 0.5, 1.0],
}


def wan22_tiny(z_dim: int, latents_mean: list[float], latents_std: list[float]) -> dict[str, Any]:
    """Wan 2.2's layout (residual levels, 2x2 patches into 12 channels, 16x spatial compression) at a tiny
    width, with a decoder wider than the encoder as the released one (160 / 256)."""
    return {
        "base_dim": 8,
        "decoder_base_dim": 12,
        "z_dim": z_dim,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "is_residual": True,
        "in_channels": 12,
        "out_channels": 12,
        "patch_size": 2,
        "scale_factor_spatial": 16,
        "scale_factor_temporal": 4,
        "latents_mean": latents_mean,
        "latents_std": latents_std,
    }


#: The DC-AE of Sana at a tiny width (f = 4): ResBlock then EfficientViT stages (the last with a 5x5
#: multi-scale branch), stride-2 conv down ("Conv", as the released config spells it), interpolate + conv
#: up; the layers per stage are each test's.
DC_STAGES: dict[str, Any] = {
    "latent_channels": 8,
    "attention_head_dim": 8,
    "encoder_block_types": ["ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
    "decoder_block_types": ["ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
    "encoder_block_out_channels": [8, 16, 32],
    "decoder_block_out_channels": [8, 16, 32],
    "encoder_qkv_multiscales": [[], [], [5]],
    "decoder_qkv_multiscales": [[], [], [5]],
    "downsample_block_type": "Conv",
    "upsample_block_type": "interpolate",
    "decoder_norm_types": "rms_norm",
    "decoder_act_fns": "silu",
}


def perturb_gains(model: torch.nn.Module) -> None:
    """Diffusers starts the RMS-norm gains at one; move every tensor so a misrouted weight shows."""
    perturb_parameters(model, 0.02, gain_suffix="gamma")
