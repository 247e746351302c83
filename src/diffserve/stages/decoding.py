"""DecodingStage: unpack latents, undo the VAE's scaling/shift, decode, and convert to PIL images."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.latent_preparation import unpack_latents


def tensor_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """(B, 3, H, W) in [-1, 1] -> PIL images, rounding as Diffusers' image processor does."""
    array = (images / 2 + 0.5).clamp(0, 1).cpu().permute(0, 2, 3, 1).float().numpy()
    array = (array * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in array]


class DecodingStage(Stage):
    needs = ("latents", "latent_height", "latent_width")
    sets = ("images",)

    def __init__(self, vae: nn.Module, packed_latents: bool = True) -> None:
        self.vae = vae
        self.packed_latents = packed_latents  # FLUX packs 2x2 patches into tokens; SD3 keeps an image
        self.scaling_factor = float(vae.config["scaling_factor"])
        self.shift_factor = float(vae.config.get("shift_factor") or 0.0)

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = req.latents
        if self.packed_latents:
            latents = unpack_latents(latents, req.latent_height, req.latent_width)
        latents = latents / self.scaling_factor + self.shift_factor
        req.images = tensor_to_pil(self.vae.decode(to_module(self.vae, latents)))
        return req
