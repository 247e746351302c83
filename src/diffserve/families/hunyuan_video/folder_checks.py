"""Load-time checks that a HunyuanVideo folder's components fit together as Diffusers'
`HunyuanVideoPipeline` / `HunyuanVideoImageToVideoPipeline` use them.

Those pipelines draw noise with the DiT's channels (text-to-video and "token_replace": `in_channels`;
"latent_concat": `(in_channels - 1) / 2`, beside the image latents and a mask), step it with the DiT's
prediction and hand it to the VAE's decoder; the DiT reads the Llama (Llava) hidden states and CLIP's
pooled text. A folder whose configs disagree (a DiT `in_channels` / `out_channels` other than the VAE's
`latent_channels` asks for, a `text_embed_dim` other than the Llama width, a `pooled_projection_dim` other
than CLIP's) makes Diffusers fail with a shape error in the middle of a generation; diffserve refuses it
when it loads, naming the config keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffserve.loader.folder_fit import refuse_unfit_folder
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformerConfig


def dit_in_channels(latent_channels: int, image_condition_type: str | None, image_to_video: bool) -> int:
    """The `in_channels` the pipeline feeds the DiT: the noisy latents' channels, plus (image-to-video's
    "latent_concat") the image latents' and a mask's."""
    if image_to_video and image_condition_type == "latent_concat":
        return 2 * latent_channels + 1
    return latent_channels


def check_hunyuan_video_folder(
    dit: HunyuanVideoTransformerConfig,
    vae_config: Mapping[str, Any],
    text_width: int,
    pooled_width: int,
    image_to_video: bool,
) -> None:
    """ModelLoadError naming the config keys unless the DiT (`transformer/config.json`), the VAE, the Llama
    states (`text_width` channels) and CLIP's pooled text (`pooled_width`) fit together as the text-to-video
    (`image_to_video` False) or image-to-video pipeline uses them."""
    latent = int(vae_config["latent_channels"])
    condition = dit.image_condition_type
    want_in = dit_in_channels(latent, condition, image_to_video)
    problems = []
    if dit.in_channels != want_in:
        fed = "the noisy latents, the image latents and a mask" if want_in != latent else "the noisy latents"
        problems.append(
            f"transformer in_channels={dit.in_channels}, but the pipeline feeds the DiT {fed}: {want_in} "
            f"channels for the VAE's latent_channels={latent} (image_condition_type={condition!r})"
        )
    if dit.out_channels != latent:
        problems.append(
            f"transformer out_channels={dit.out_channels} differs from the VAE's latent_channels={latent}: "
            "the prediction steps the latents the VAE decodes"
        )
    if dit.text_embed_dim != text_width:
        problems.append(
            f"transformer text_embed_dim={dit.text_embed_dim} differs from the text encoder's hidden_size "
            f"({text_width})"
        )
    if dit.pooled_projection_dim != pooled_width:
        problems.append(
            f"transformer pooled_projection_dim={dit.pooled_projection_dim} differs from the CLIP text "
            f"encoder's (text_encoder_2) hidden_size ({pooled_width})"
        )
    refuse_unfit_folder("HunyuanVideo", problems)
