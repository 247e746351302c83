"""Load-time checks that a HunyuanVideo 1.5 folder's components fit together as Diffusers'
`HunyuanVideo15Pipeline` / `HunyuanVideo15ImageToVideoPipeline` use them.

Those pipelines draw noise with the VAE's `latent_channels`, feed the DiT [noise; condition latents; mask]
(2 * latent_channels + 1 channels), step the noise with the DiT's prediction and decode it; the DiT reads
Qwen2.5-VL's states, ByT5's glyph states and (image-to-video) SigLIP's. A folder whose configs disagree
(a DiT `in_channels` / `out_channels` other than those, a `text_embed_dim`, `text_embed_2_dim` or
`image_embed_dim` other than its encoder's width) makes Diffusers fail with a shape error in the middle of
a generation; diffserve refuses it when it loads, naming the config keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffserve.loader.folder_fit import refuse_unfit_folder
from diffserve.models.dits.hunyuan_video15 import HunyuanVideo15TransformerConfig


def check_hunyuan_video15_folder(
    dit: HunyuanVideo15TransformerConfig,
    vae_config: Mapping[str, Any],
    text_width: int,
    glyph_width: int,
    image_width: int | None,
) -> None:
    """ModelLoadError naming the config keys unless the DiT (`transformer/config.json`), the VAE, the
    Qwen2.5-VL states (`text_width` channels), ByT5's (`glyph_width`) and, for image-to-video, SigLIP's
    (`image_width`; None for text-to-video, which passes zero image states of the DiT's own width) fit
    together as the pipelines use them."""
    latent = int(vae_config["latent_channels"])
    problems = []
    if dit.in_channels != 2 * latent + 1:
        problems.append(
            f"transformer in_channels={dit.in_channels}, but the pipeline feeds the DiT the noisy latents, "
            f"the condition latents and a mask: {2 * latent + 1} channels for the VAE's latent_channels={latent}"
        )
    if dit.out_channels != latent:
        problems.append(
            f"transformer out_channels={dit.out_channels} differs from the VAE's latent_channels={latent}: "
            "the prediction steps the latents the VAE decodes"
        )
    widths = [
        ("text_embed_dim", dit.text_embed_dim, "the text encoder's (Qwen2.5-VL) hidden_size", text_width),
        (
            "text_embed_2_dim",
            dit.text_embed_2_dim,
            "the glyph encoder's (text_encoder_2, ByT5) d_model",
            glyph_width,
        ),
    ]
    if image_width is not None:
        widths.append(
            ("image_embed_dim", dit.image_embed_dim, "the image encoder's hidden_size", image_width)
        )
    for key, value, what, width in widths:
        if value != width:
            problems.append(f"transformer {key}={value} differs from {what} ({width})")
    refuse_unfit_folder("HunyuanVideo 1.5", problems)
