"""Load-time checks that a Qwen-Image folder's components fit together as Diffusers' Qwen-Image pipelines
use them.

Those pipelines pack the VAE latents in 2x2 patches themselves (`in_channels // 4` latent channels), read
one prediction per packed token back into the same layout, normalise the latents with the VAE's
per-channel `latents_mean` / `latents_std` viewed as `z_dim` channels, take `2 ** len(temperal_downsample)`
as the VAE's compression, and feed the text encoder's last hidden states to the DiT's `txt_norm`. A folder
whose configs disagree with that makes Diffusers fail with a shape error in the middle of a generation (a
DiT `patch_size` other than 2, `in_channels` other than four times `out_channels` or than four times the
VAE's `z_dim`, latent statistics of another length, a `joint_attention_dim` other than the text encoder's
width), fail to build the VAE or give images of the wrong size (a `temperal_downsample` without one entry
per VAE downsampling level); so does a DiT with `use_additional_t_cond` outside the Layered pipeline (the
others pass no `additional_t_cond`), and a VAE whose `input_channels` are not the pixels the pipeline
encodes (RGB for the Edit pipelines, RGBA for Layered). diffserve refuses such a folder when it loads,
naming the keys.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from diffserve.loader.folder_fit import encoder_hidden_size, refuse_unfit_folder
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel

#: The latent patch the pipelines fold into channels (`_pack_latents`, hard-coded 2x2).
PIPELINE_LATENT_PATCH = 2


def pixel_channels_key(vae_config: dict[str, Any]) -> str:
    """The VAE config key of its pixel channels: `input_channels` (AutoencoderKLQwenImage) or `in_channels`
    (a Wan VAE, which the pipelines read through the same attributes)."""
    return "input_channels" if "input_channels" in vae_config else "in_channels"


def check_qwen_image_folder(
    transformer: QwenImageTransformer2DModel,
    vae: nn.Module,
    text_encoder: nn.Module,
    pipeline_name: str,
    *,
    layered: bool = False,
    pixel_channels: int | None = None,
) -> None:
    """ModelLoadError naming the config keys unless the DiT, the VAE and the text encoder fit together as
    Diffusers' `pipeline_name` uses them. `layered`: the pipeline passes `additional_t_cond` (Layered);
    `pixel_channels`: the VAE `input_channels` the pipeline's input images need (None: any)."""
    dit, vae_config = transformer.config, vae.config
    problems = []
    if dit.patch_size != PIPELINE_LATENT_PATCH:
        problems.append(
            f"transformer patch_size={dit.patch_size}: the pipeline packs 2x2 latent patches itself, so the "
            f"DiT's patch_size must be {PIPELINE_LATENT_PATCH}"
        )
    packed = PIPELINE_LATENT_PATCH**2
    if dit.in_channels != packed * dit.out_channels:
        problems.append(
            f"transformer in_channels={dit.in_channels} is not {packed} x out_channels={dit.out_channels}: "
            "the prediction must have the packed latent tokens' channels"
        )
    levels, downsampling = len(vae_config["dim_mult"]), list(vae_config["temperal_downsample"])
    if len(downsampling) != levels - 1:
        problems.append(
            f"vae temperal_downsample={downsampling} needs one entry per downsampling level "
            f"(len(dim_mult) - 1 = {levels - 1}): the pipeline takes 2 ** len(temperal_downsample) as the "
            "VAE's compression"
        )
    z_dim = int(vae_config["z_dim"])
    if dit.in_channels != packed * z_dim:
        problems.append(
            f"transformer in_channels={dit.in_channels} is not {packed} x the VAE's z_dim={z_dim} (the "
            "packed latent channels)"
        )
    for key in ("latents_mean", "latents_std"):
        if len(vae_config[key]) != z_dim:
            problems.append(f"vae {key} has {len(vae_config[key])} entries, not z_dim={z_dim}")
    width = encoder_hidden_size(text_encoder)
    if dit.joint_attention_dim != width:
        problems.append(
            f"transformer joint_attention_dim={dit.joint_attention_dim} differs from the text encoder's "
            f"hidden_size={width}"
        )
    if dit.use_additional_t_cond and not layered:
        problems.append(
            "transformer use_additional_t_cond=true is Qwen-Image-Layered's: "
            f"{pipeline_name} passes no additional_t_cond"
        )
    key = pixel_channels_key(vae_config)
    if pixel_channels is not None and int(vae_config[key]) != pixel_channels:
        problems.append(
            f"vae {key}={vae_config[key]}: {pipeline_name} encodes {pixel_channels}-channel images"
        )
    refuse_unfit_folder(pipeline_name, problems)
