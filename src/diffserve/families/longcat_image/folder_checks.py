"""Load-time checks that a LongCat-Image (or -Edit) folder's components fit together as Diffusers'
`LongCatImagePipeline` / `LongCatImageEditPipeline` use them.

Those pipelines draw 16-channel latents (hard-coded), pack them into 2x2 patches (64 channels a token),
read one prediction per token and decode with the VAE; the DiT reads the Qwen2.5-VL states as they are. A
folder whose configs disagree (a DiT `patch_size` other than 1, `in_channels` other than 64, a VAE with
other `latent_channels` than 16, a `joint_attention_dim` other than the text encoder's hidden size) makes
Diffusers fail with a shape error in the middle of a generation; diffserve refuses it at load, naming the
keys.
"""

from __future__ import annotations

from typing import Any

from diffserve.loader.folder_fit import refuse_unfit_folder
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel

#: Latent pixels per token side: the pipelines pack 2x2 latent patches.
PACKED_PATCH = 2


def check_longcat_image_folder(
    transformer: LongCatImageTransformer2DModel,
    vae_config: dict[str, Any],
    latent_channels: int,
    text_width: int,
) -> None:
    """ModelLoadError naming the config keys unless the DiT, the VAE (`vae_config`) and the text encoder's
    states (`text_width` channels) fit the pipeline's `latent_channels`-channel latents."""
    dit = transformer.config
    packed = latent_channels * PACKED_PATCH**2
    problems = []
    if dit.patch_size != 1:
        problems.append(
            f"transformer patch_size={dit.patch_size}: the pipeline packs 2x2 latent patches itself and reads "
            "one prediction per token, so the DiT's patch_size must be 1"
        )
    if dit.in_channels != packed:
        problems.append(
            f"transformer in_channels={dit.in_channels}: the pipeline's tokens are {latent_channels}-channel "
            f"latents packed 2x2 ({packed} channels)"
        )
    if vae_config["latent_channels"] != latent_channels:
        problems.append(
            f"vae latent_channels={vae_config['latent_channels']}: the pipeline draws and decodes "
            f"{latent_channels}-channel latents"
        )
    if dit.joint_attention_dim != text_width:
        problems.append(
            f"transformer joint_attention_dim={dit.joint_attention_dim} differs from the text encoder's "
            f"hidden_size ({text_width})"
        )
    refuse_unfit_folder("LongCat-Image", problems)
