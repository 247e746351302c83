"""Load-time checks that a Z-Image folder's components fit together as Diffusers' `ZImagePipeline` uses them.

The pipeline calls the DiT with its default patch sizes (2x2 spatial, 1 temporal), gives it the VAE's
latents (`in_channels` of them) and the text encoder's hidden states (`cap_feat_dim` wide). A folder whose
DiT lists no 2-1 patch pair in `all_patch_size` / `all_f_patch_size`, whose DiT `in_channels` differ from
the VAE's `latent_channels`, or whose `cap_feat_dim` differs from the text encoder's `hidden_size` makes
Diffusers fail in the middle of a generation (an assertion, or a shape error). diffserve refuses such a
folder when it loads, naming the keys.
"""

from __future__ import annotations

from torch import nn

from diffserve.loader.folder_fit import encoder_hidden_size, refuse_unfit_folder
from diffserve.models.dits.z_image import ZImageTransformer2DModel

#: The (spatial, temporal) patch size the pipelines run the DiT with (its forward's defaults).
PIPELINE_PATCH = (2, 1)


def check_z_image_folder(
    transformer: ZImageTransformer2DModel, vae: nn.Module, text_encoder: nn.Module
) -> None:
    """ModelLoadError naming the config keys unless the DiT, the VAE and the text encoder fit together."""
    dit = transformer.config
    problems = []
    pairs = list(zip(dit.all_patch_size, dit.all_f_patch_size, strict=True))
    if PIPELINE_PATCH not in pairs:
        problems.append(
            f"transformer all_patch_size={list(dit.all_patch_size)} / all_f_patch_size="
            f"{list(dit.all_f_patch_size)} have no {PIPELINE_PATCH[0]}-{PIPELINE_PATCH[1]} pair, the patch "
            "size the pipeline runs the DiT with"
        )
    latent_channels = int(vae.config["latent_channels"])
    if dit.in_channels != latent_channels:
        problems.append(
            f"transformer in_channels={dit.in_channels} differs from the VAE's latent_channels={latent_channels}"
        )
    width = encoder_hidden_size(text_encoder)
    if dit.cap_feat_dim != width:
        problems.append(
            f"transformer cap_feat_dim={dit.cap_feat_dim} differs from the text encoder's hidden_size={width}"
        )
    refuse_unfit_folder("ZImagePipeline", problems)
