"""FLUX.1 Fill's conditioning (Diffusers' `FluxFillPipeline.prepare_mask_latents`): the input image with
its masked area blacked out, VAE-encoded, and the mask's pixels folded into channels, both packed 2x2 and
joined on the channel axis of every noisy image token."""

from __future__ import annotations

import torch
from torch import nn

from diffserve.families.flux.conditioning import FluxFillConditioning
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.image_to_image import encode_sampled, resized_input
from diffserve.stages.latent_preparation import pack_latents
from diffserve.stages.mask_preparation import mask_pixels


def mask_channels(mask: torch.Tensor, vae_scale_factor: int) -> torch.Tensor:
    """(B, 1, H, W) pixel mask -> (B, s*s, H/s, W/s): each latent pixel's s x s mask pixels as channels
    (s = `vae_scale_factor`), in Diffusers' (row, column) order."""
    b, _, height, width = mask.shape
    s = vae_scale_factor
    grid = mask[:, 0].view(b, height // s, s, width // s, s).permute(0, 2, 4, 1, 3)
    return grid.reshape(b, s * s, height // s, width // s)


class FluxFillPreparationStage(Stage):
    """Sets `FluxFillConditioning.channel_condition` (batch, tokens, 64 + 4 * s * s): the masked image's packed latents, drawn
    from the posterior with the request's generator after its initial noise (Diffusers' order), then the
    packed mask channels. Needs the input image and the mask (validation guarantees both)."""

    needs = ("generator", "latents")
    sets = ("conditioning.channel_condition",)

    def __init__(
        self, vae: nn.Module, vae_scale_factor: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.vae = vae
        self.vae_scale_factor = vae_scale_factor
        self.device = device
        self.dtype = dtype

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        pixels = image_to_tensor(resized_input(req))
        mask = mask_pixels(p.mask_image, p.height, p.width)
        masked = encode_sampled(self.vae, pixels * (1 - mask), req.generator)
        masked = pack_latents(masked.to(device=self.device, dtype=self.dtype))
        folded = pack_latents(
            mask_channels(mask, self.vae_scale_factor).to(device=self.device, dtype=self.dtype)
        )
        condition = torch.cat([masked, folded], dim=-1)
        FluxFillConditioning.of(req).channel_condition = condition.repeat(req.batch_size, 1, 1)
        return req
