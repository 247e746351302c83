"""Previews in mid-denoising: the predicted clean latent `x0 = x_{i+1} - sigma_{i+1} * v` (flow matching,
`v = noise - x0` kept on `Req.last_prediction`; UniPC keeps x0 itself), decoded by the pipeline's own
VAE, from pooled latents above `PREVIEW_MAX_PIXELS` (a video: its first frame)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from PIL import Image

from diffserve.request import Req
from diffserve.stages.base import to_module
from diffserve.stages.decoding import DecodeLayout, LatentDecoder, tensor_to_pil
from diffserve.stages.latent_preparation import unpack_latents
from diffserve.stages.video_vae_decoding import denormalize_latents

PREVIEW_MAX_PIXELS = 1024 * 1024


def predicted_clean_latents(req: Req) -> torch.Tensor:
    """x0 after the request's last step, in its own latent layout (packed, spatial or video), float32."""
    if req.last_prediction is None or req.step_index == 0:
        raise ValueError(f"request {req.request_id} has not taken a denoising step yet: nothing to preview")
    history = getattr(req.scheduler_state, "model_outputs", None)
    if history and history[-1] is not None:  # UniPC: the data prediction of the step it just took
        return history[-1].float()
    assert req.schedule is not None
    # The CPU copy: reading the device schedule would sync.
    sigma = float(req.schedule.host_sigmas[req.step_index])
    return req.latents.float() - sigma * req.last_prediction.float()


def pool_factor(height: int, width: int, max_pixels: int = PREVIEW_MAX_PIXELS) -> int:
    """Smallest integer s such that an image of (height / s) x (width / s) has at most `max_pixels`."""
    return max(1, math.ceil(math.sqrt(height * width / max_pixels)))


def _vae_latents(layout: DecodeLayout, req: Req, x0: torch.Tensor) -> torch.Tensor:
    """x0 -> what the decoder takes (a video VAE: the first latent frame, (batch, channels, 1, h, w))."""
    if layout.packed:
        x0 = unpack_latents(x0, *req.latent_size)
        if layout.video_vae:
            x0 = x0.unsqueeze(2)
    if layout.video_vae:
        return x0[:, :, :1]
    return x0 / layout.scaling_factor + layout.shift_factor


@torch.inference_mode()
def preview_images(
    decoder: LatentDecoder, req: Req, max_pixels: int = PREVIEW_MAX_PIXELS
) -> list[Image.Image]:
    """One preview per output of `req` through the pipeline's decoding stage `decoder`, as large as its
    final images; call it between steps (from `Req.on_step`): it never changes the request."""
    layout = decoder.decode_layout()
    latents = _vae_latents(layout, req, predicted_clean_latents(req))
    h, w = latents.shape[-2:]
    factor = int(layout.vae.spatial_compression_ratio)
    size = (h * factor, w * factor)
    s = pool_factor(*size, max_pixels)
    latents = to_module(layout.vae, latents)
    if s > 1:
        pooled = (max(1, round(h / s)), max(1, round(w / s)))
        flat = latents.squeeze(2) if layout.video_vae else latents
        flat = F.interpolate(flat.float(), size=pooled, mode="area").to(latents.dtype)
        latents = flat.unsqueeze(2) if layout.video_vae else flat
    if layout.video_vae:
        latents = denormalize_latents(layout.vae, latents)
        rgb = layout.vae.decode(latents)[:, :, 0]
    else:
        rgb = layout.vae.decode(latents)
    if tuple(rgb.shape[-2:]) != size:
        rgb = F.interpolate(rgb.float(), size=size, mode="bilinear", align_corners=False)
    return tensor_to_pil(rgb)
