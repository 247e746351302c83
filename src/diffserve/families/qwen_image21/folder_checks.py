"""Load-time checks that a Qwen-Image 2.1 folder's components fit together as Diffusers'
`QwenImage21Pipeline` uses them.

The pipeline hard-codes a 16x VAE (`vae_scale_factor = 16`: latents of height / 16 by width / 16, decoded
by whatever the VAE is), feeds the DiT the VAE's unpatched latents (`in_channels` of them, one token per
latent pixel) and reads one prediction of the same width back, and gives it the text encoder's last hidden
states (`context_in_dim` wide). A VAE of another compression (`dim_mult` / `temperal_downsample` of another
length) makes Diffusers return images of the wrong size; a DiT whose `in_channels` or `out_channels`
differ from the VAE's `z_dim`, or whose `context_in_dim` differs from the text encoder's width, makes it
fail with a shape error in the middle of a generation. diffserve refuses such a folder when it loads,
naming the keys.
"""

from __future__ import annotations

from torch import nn

from diffserve.families.qwen_image21.stages import PIPELINE_NAME
from diffserve.loader.folder_fit import encoder_hidden_size, refuse_unfit_folder
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel


def check_qwen_image21_folder(
    transformer: QwenImage21Transformer2DModel, vae: nn.Module, text_encoder: nn.Module, scale: int
) -> None:
    """ModelLoadError naming the config keys unless the DiT, the VAE (of `scale`x compression) and the text
    encoder fit together."""
    dit, vae_config = transformer.config, vae.config
    problems = []
    if vae.spatial_compression_ratio != scale:
        problems.append(
            f"the VAE compresses {vae.spatial_compression_ratio}x (2 ** len(temperal_downsample), "
            f"temperal_downsample={list(vae_config['temperal_downsample'])}), the pipeline needs {scale}x "
            f"({scale.bit_length() - 1} downsampling levels: dim_mult of {scale.bit_length()} entries)"
        )
    z_dim = int(vae_config["z_dim"])
    for key in ("in_channels", "out_channels"):
        if getattr(dit, key) != z_dim:
            problems.append(f"transformer {key}={getattr(dit, key)} differs from the VAE's z_dim={z_dim}")
    width = encoder_hidden_size(text_encoder)
    if dit.context_in_dim != width:
        problems.append(
            f"transformer context_in_dim={dit.context_in_dim} differs from the text encoder's hidden_size={width}"
        )
    refuse_unfit_folder(PIPELINE_NAME, problems)
