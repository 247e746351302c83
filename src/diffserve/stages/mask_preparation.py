"""Inpainting masks at latent resolution, and the blend that keeps the unmasked area after every step.

The mask (an "L" image, 255 = edit, from `diffserve.masks.edit_mask`) is read as Diffusers' mask
processor reads it: resized to the output size (Lanczos), scaled to [0, 1], binarized at 0.5 (no blur,
`padding_mask_crop` not supported), then resized to the latent grid by nearest-neighbour interpolation.
After each step the unmasked area is replaced by the input image's latents re-noised to the next sigma
(to the clean latents after the last step), as Diffusers' inpaint pipelines do.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.image_to_image import LatentLayout, noised


def mask_pixels(mask: Image.Image, height: int, width: int) -> torch.Tensor:
    """(1, 1, height, width) float32 of 0 (keep) and 1 (edit): Diffusers' `VaeImageProcessor` with
    `do_binarize=True, do_convert_grayscale=True, do_normalize=False`."""
    resized = mask.resize((width, height), Image.Resampling.LANCZOS).convert("L")
    values = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0)[None, None]
    return (values >= 0.5).to(torch.float32)


class InpaintMaskStage(Stage):
    """`input_latents.mask`: the binarized mask on the latent grid, one channel per latent channel, in the
    family's latent layout (`layout`), one copy per output. Runs after `ImageToImageNoisingStage` (the
    blend re-noises the input image's latents with the request's noise)."""

    needs = ("latents", "latent_size")

    def __init__(self, latent_channels: int, layout: LatentLayout) -> None:
        self.latent_channels = latent_channels
        self.layout = layout

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        if p.mask_image is None:
            return req
        pixels = mask_pixels(p.mask_image, p.height, p.width)
        grid = F.interpolate(pixels, size=req.latent_size)
        grid = grid.to(device=req.latents.device, dtype=req.latents.dtype)
        latent_mask = self.layout(grid.repeat(1, self.latent_channels, 1, 1))
        if req.input_latents is None:
            raise ValueError("an inpainting mask needs the input image's latents (InputImageEncodingStage)")
        req.input_latents.mask = latent_mask.repeat(req.batch_size, *([1] * (latent_mask.dim() - 1)))
        return req


def keep_unmasked(req: Req, latents: torch.Tensor) -> torch.Tensor:
    """`latents` just stepped from `req.step_index`, with the area outside the request's mask set back to
    its input image at the next sigma (the clean image after the last step)."""
    source = req.input_latents
    assert source is not None and source.noise is not None and source.mask is not None
    following = req.step_index + 1
    kept = source.latents
    if following < req.num_steps:
        kept = noised(source.latents, source.noise, req.schedule.sigmas[following])
    return (1 - source.mask) * kept + source.mask * latents
