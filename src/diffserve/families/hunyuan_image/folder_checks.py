"""Load-time checks that a HunyuanImage 2.1 folder's components fit together as Diffusers'
`HunyuanImagePipeline` uses them.

That pipeline draws `transformer.in_channels`-channel latents, steps them with the DiT's prediction and
decodes them with the VAE; the DiT reads the Qwen2.5-VL states (`text_embed_dim` channels) and the ByT5
glyph states (`text_embed_2_dim`). A folder whose configs disagree (an `out_channels` other than
`in_channels`, `in_channels` other than the VAE's `latent_channels`, a text width other than the encoder's)
makes Diffusers fail with a shape error in the middle of a generation; diffserve refuses it at load,
naming the keys. A patch that is not square is refused too: the requests' sizes have one pixel multiple
(Diffusers runs only the sizes whose latents both patch sides divide).
"""

from __future__ import annotations

from diffserve.loader.folder_fit import refuse_unfit_folder
from diffserve.models.dits.hunyuan_image import HunyuanImageTransformerConfig


def check_hunyuan_image_folder(
    dit: HunyuanImageTransformerConfig, vae_latent_channels: int, text_width: int, glyph_width: int
) -> None:
    """ModelLoadError naming the config keys unless the DiT config `dit` fits the VAE's latents and the
    widths of the Qwen2.5-VL (`text_width`) and ByT5 (`glyph_width`) states."""
    problems = []
    if dit.patch_size[0] != dit.patch_size[1]:
        problems.append(
            f"transformer patch_size={list(dit.patch_size)} is not square (diffserve takes square patches, "
            "the released DiTs' [1, 1])"
        )
    if dit.out_channels != dit.in_channels:
        problems.append(
            f"transformer out_channels={dit.out_channels} differs from in_channels={dit.in_channels}: the "
            "prediction steps the latents"
        )
    if dit.in_channels != vae_latent_channels:
        problems.append(
            f"transformer in_channels={dit.in_channels} differs from the VAE's latent_channels "
            f"({vae_latent_channels})"
        )
    if dit.text_embed_dim != text_width:
        problems.append(
            f"transformer text_embed_dim={dit.text_embed_dim} differs from the text encoder's hidden_size "
            f"({text_width})"
        )
    if dit.text_embed_2_dim is not None and dit.text_embed_2_dim != glyph_width:
        problems.append(
            f"transformer text_embed_2_dim={dit.text_embed_2_dim} differs from text_encoder_2's d_model "
            f"({glyph_width})"
        )
    refuse_unfit_folder("HunyuanImage", problems)
