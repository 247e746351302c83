"""Load-time checks that a FLUX.2 folder's components fit together as Diffusers' Flux2Pipeline /
Flux2KleinPipeline use them.

Those pipelines patchify the VAE latents 2x2 themselves, feed one packed patch per DiT token and read one
prediction per token back into the same layout; they concatenate three text-encoder hidden states per
token. A folder whose configs disagree with that (a DiT `patch_size` other than 1, `out_channels` other
than `in_channels`, `in_channels` other than the VAE's patchified latent channels, a VAE `patch_size`
other than 2x2, a `joint_attention_dim` other than three text-encoder widths) makes Diffusers fail
with a shape error in the middle of a generation. diffserve refuses it when it loads, naming the keys.
"""

from __future__ import annotations

from diffserve.loader.folder_fit import refuse_unfit_folder
from diffserve.models.dits.flux2 import Flux2Transformer2DModel
from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2

#: The latent patch Diffusers' FLUX.2 pipelines fold into channels (`_patchify_latents`, hard-coded).
PIPELINE_LATENT_PATCH = (2, 2)


def check_flux2_folder(
    transformer: Flux2Transformer2DModel, vae: AutoencoderKLFlux2, text_state_width: int
) -> None:
    """ModelLoadError naming the config keys unless the DiT, the VAE and the text states
    (`text_state_width` channels per token) fit together as the Diffusers pipelines use them."""
    dit = transformer.config
    problems = []
    if dit.patch_size != 1:
        problems.append(
            f"transformer patch_size={dit.patch_size}: the pipeline packs 2x2 latent patches itself and "
            "reads one prediction per token, so the DiT's patch_size must be 1"
        )
    if dit.out_channels != dit.in_channels:
        problems.append(
            f"transformer out_channels={dit.out_channels} differs from in_channels={dit.in_channels}: the "
            "prediction must have the latent tokens' channels"
        )
    vae_patch = tuple(vae.config["patch_size"])
    if vae_patch != PIPELINE_LATENT_PATCH:
        problems.append(
            f"vae patch_size={list(vae_patch)}: the pipeline patchifies latents "
            f"{PIPELINE_LATENT_PATCH[0]}x{PIPELINE_LATENT_PATCH[1]} whatever the VAE's config says, so it "
            f"must be {list(PIPELINE_LATENT_PATCH)}"
        )
    token_channels = vae.bn.num_features
    if dit.in_channels != token_channels:
        problems.append(
            f"transformer in_channels={dit.in_channels} differs from the VAE's patchified latent channels "
            f"({token_channels} = patch_size {list(vae_patch)} x latent_channels "
            f"{vae.config['latent_channels']})"
        )
    if dit.joint_attention_dim != text_state_width:
        problems.append(
            f"transformer joint_attention_dim={dit.joint_attention_dim} differs from the text states' width "
            f"({text_state_width}: the text encoder's hidden_size times the hidden states read)"
        )
    refuse_unfit_folder("FLUX.2", problems)
