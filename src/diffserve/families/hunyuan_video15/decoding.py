"""HunyuanVideo 1.5's decoding: the DiT's latents divided by the VAE's scaling factor (no per-channel
statistics, unlike Wan's VAE), decoded to frames."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.distributed.parallel_vae import decode_split
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout, tensor_to_pil
from diffserve.stages.previews import predicted_clean_latents


class HunyuanVideo15DecodingStage(Stage):
    """(B, C, F, h, w) latents -> one uint8 (frames, H, W, 3) array per output video."""

    needs = ("latents",)
    sets = ("outputs.frames",)

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae
        self.scaling_factor = float(vae.config["scaling_factor"])

    def decode_layout(self) -> DecodeLayout:
        """The layout, for completeness: the generic previews assume Wan's per-channel statistics for a
        video VAE, so the pipeline previews through `preview_images` here instead."""
        return DecodeLayout(self.vae, packed=False, video_vae=True, scaling_factor=self.scaling_factor)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT's latents -> the VAE's output video (B, 3, frames, H, W) in [-1, 1]."""
        return decode_split(self.vae, to_module(self.vae, latents) / self.scaling_factor)

    @torch.inference_mode()
    def preview_images(self, req: Req) -> list[Image.Image]:
        """The first frame of the clean video predicted at the request's last step, one per output."""
        first_frame = predicted_clean_latents(req)[:, :, :1]
        return tensor_to_pil(self.vae.decode(to_module(self.vae, first_frame) / self.scaling_factor)[:, :, 0])

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        video = self.decode(req.latents)
        array = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu().numpy()
        # Rounding as Diffusers' processors do.
        req.outputs.frames = list((array * 255).round().astype(np.uint8))
        return req
