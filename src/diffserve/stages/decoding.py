"""DecodingStage: unpack latents, undo the VAE's scaling/shift, decode, and convert to PIL images.

With several ranks every rank runs this stage and the decode is split by rows over them
(`diffserve.distributed.parallel_vae.decode_split`; on one device it is `vae.decode`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.distributed.parallel_vae import decode_split
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.latent_preparation import unpack_latents


def tensor_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """(B, 3, H, W) in [-1, 1] -> PIL images, rounding as Diffusers' image processor does."""
    array = (images / 2 + 0.5).clamp(0, 1).cpu().permute(0, 2, 3, 1).float().numpy()
    array = (array * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in array]


@dataclass(frozen=True)
class DecodeLayout:
    """How a pipeline's latents reach its VAE (what previews need to decode a mid-denoising x0)."""

    vae: nn.Module
    packed: bool  # FLUX / Qwen-Image: 2x2 latent patches packed into tokens
    video_vae: bool  # Qwen-Image / Wan: (batch, channels, frames, h, w), latents normalised per channel
    scaling_factor: float = 1.0  # AutoencoderKL: DiT latent = (z - shift) * scaling
    shift_factor: float = 0.0


@runtime_checkable
class LatentDecoder(Protocol):
    """A pipeline's decoding stage, the stage right after its denoising steps."""

    def decode_layout(self) -> DecodeLayout: ...


class DecodingStage(Stage):
    needs = ("latents", "latent_size")
    sets = ("outputs.images",)

    def __init__(self, vae: nn.Module, packed_latents: bool = True) -> None:
        self.vae = vae
        self.packed_latents = packed_latents  # FLUX packs 2x2 patches into tokens; SD3 keeps an image
        self.scaling_factor = float(vae.config["scaling_factor"])
        self.shift_factor = float(vae.config.get("shift_factor") or 0.0)

    def decode_layout(self) -> DecodeLayout:
        return DecodeLayout(self.vae, self.packed_latents, False, self.scaling_factor, self.shift_factor)

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = req.latents
        if self.packed_latents:
            latents = unpack_latents(latents, *req.latent_size)
        latents = latents / self.scaling_factor + self.shift_factor
        req.outputs.images = tensor_to_pil(decode_split(self.vae, to_module(self.vae, latents)))
        return req
