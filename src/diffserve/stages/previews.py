"""Previews of a request in mid-denoising: what the image would be if sampling stopped now.

What is previewed: the *predicted clean latent* x0, not the noisy latent. Every family here samples
a flow-matching ODE, `x_sigma = (1 - sigma) * x0 + sigma * noise`, whose velocity `v = noise - x0`
gives `x0 = x_sigma - sigma * v`. The denoisers keep the guided velocity of the last step on
`Req.last_prediction` (set in `pipelines/cfg_batch.advance_requests`, in the sign convention the
scheduler used, so Z-Image's negated DiT output is already flipped back). After the step at index i
the request holds `x_{i+1}`, and the Euler scheduler moved it by `x_{i+1} = x_i + (sigma_{i+1} -
sigma_i) * v`, so

    x0 = x_i - sigma_i * v = x_{i+1} - sigma_{i+1} * v

needs neither a copy of `x_i` nor any work in the step itself. UniPC (Wan) does not move along `v`
alone; it keeps the x0 of the step it just took as the newest entry of its history, used as is. At
the last step sigma is 0 and x0 is the final latent.

How x0 becomes pixels: the pipeline's own VAE decodes it, at full size up to `PREVIEW_MAX_PIXELS`
(1024 x 1024) and at reduced size above: the latent grid is then area-pooled by the smallest integer
factor that brings the decode under the cap, and the result upscaled (bilinear) to the output size.
This is option "real VAE decode, reduced size only where it must be"; the alternative, a linear
latent -> RGB projection, was tried and rejected:

- a projection is a per-VAE table. Published ones exist for a few VAEs only, and one fitted by least
  squares against the loaded VAE (encode a synthetic image, regress the pooled decoded colours on the
  latents) is only as good as the decoder is linear per latent pixel. On the random test checkpoints
  it explained about a quarter of the variance of its own fitting data, and its last preview was
  uncorrelated with the final image (|correlation| < 0.2). The VAE decode is right for every VAE a
  folder ships: up to the cap the last preview *is* the final image, and earlier ones show the real
  x0 rather than colour blobs.
- cost, per preview: one VAE decode of the output (at most 1 megapixel) for all of the request's
  outputs at once. That is the request's own final decode again, so a request with k previews
  (k <= 3) decodes k + 1 times instead of once. For FLUX at 1024 x 1024 the decoder is 10.5 TFLOP
  (torch's FLOP counter on the real VAE config) against ~125 TFLOP for one step of the 12B DiT over
  4608 tokens, so 3 previews cost about a quarter of a step by FLOPs, somewhat more in time (the
  decoder's normalisations are memory-bound): a few percent of a 28-step request. Its activation
  memory is the final decode's, which admission budgets. Previews run in the engine's step loop, so the other
  requests of the batch wait for them too. Nothing is computed for requests without previews: the
  denoisers only keep a reference to a tensor they had anyway.

Above the cap (Qwen-Image's 1328 x 1328 default, 2048-pixel outputs) the pooled decode is an
approximation: decoders are not built for averaged latents. On the random test VAEs it is poor (12-26
dB PSNR against the final image, tests/unit/test_previews.py); trained VAEs, whose latents are
smooth and image-like, do much better, but no trained VAE could be measured here.

Videos (Wan): the first frame. The VAE is causal, so the video's first frame depends on the first
latent frame only and is decoded exactly, at the cost of one image; a middle frame would need every
latent frame before it decoded too. The video routes do not stream previews; this serves the
in-process API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from diffserve.request import Req
from diffserve.stages.decoding import DecodingStage, tensor_to_pil
from diffserve.stages.latent_preparation import unpack_latents
from diffserve.stages.video_vae_decoding import (
    VideoVaeDecodingStage,
    VideoVaeImageDecodingStage,
    denormalize_latents,
)

#: Largest preview the VAE decodes, in pixels (height x width); larger outputs are decoded from
#: pooled latents and upscaled.
PREVIEW_MAX_PIXELS = 1024 * 1024


@dataclass(frozen=True)
class DecodeLayout:
    """How a pipeline's latents reach its VAE, read off its decoding stage."""

    vae: nn.Module
    packed: bool  # FLUX / Qwen-Image: 2x2 latent patches packed into tokens
    video_vae: bool  # Qwen-Image / Wan: (batch, channels, frames, h, w), latents normalised per channel
    scaling_factor: float = 1.0  # AutoencoderKL: DiT latent = (z - shift) * scaling
    shift_factor: float = 0.0

    @property
    def spatial_factor(self) -> int:
        return int(self.vae.spatial_compression_ratio)


def decode_layout(pipeline) -> DecodeLayout:
    """The layout of `pipeline` (any diffserve pipeline with one of the three decoding stages)."""
    for stage in pipeline.stages:
        if isinstance(stage, DecodingStage):
            return DecodeLayout(
                stage.vae, stage.packed_latents, False, stage.scaling_factor, stage.shift_factor
            )
        if isinstance(stage, VideoVaeImageDecodingStage):
            return DecodeLayout(stage.vae, packed=True, video_vae=True)
        if isinstance(stage, VideoVaeDecodingStage):
            return DecodeLayout(stage.vae, packed=False, video_vae=True)
    raise ValueError(f"{type(pipeline).__name__} has no decoding stage that previews understand")


def predicted_clean_latents(req: Req) -> torch.Tensor:
    """x0 after the request's last step, in its own latent layout (packed, spatial or video), float32."""
    if req.last_prediction is None or req.step_index == 0:
        raise ValueError(f"request {req.request_id} has not taken a denoising step yet: nothing to preview")
    history = getattr(req.scheduler_state, "model_outputs", None)
    if history and history[-1] is not None:  # UniPC: the data prediction of the step it just took
        return history[-1].float()
    sigma = float(req.host_sigmas[req.step_index])  # the CPU copy: reading the device schedule would sync
    return req.latents.float() - sigma * req.last_prediction.float()


def pool_factor(height: int, width: int, max_pixels: int = PREVIEW_MAX_PIXELS) -> int:
    """Smallest integer s such that an image of (height / s) x (width / s) has at most `max_pixels`."""
    return max(1, math.ceil(math.sqrt(height * width / max_pixels)))


def _vae_latents(layout: DecodeLayout, req: Req, x0: torch.Tensor) -> torch.Tensor:
    """x0 -> what the decoder takes: (batch, channels, h, w), or (batch, channels, 1, h, w) for a video
    VAE (a video's first latent frame)."""
    if layout.packed:
        x0 = unpack_latents(x0, req.latent_height, req.latent_width)
        if layout.video_vae:
            x0 = x0.unsqueeze(2)
    if layout.video_vae:
        return x0[:, :, :1]
    return x0 / layout.scaling_factor + layout.shift_factor


@torch.inference_mode()
def preview_images(pipeline, req: Req, max_pixels: int = PREVIEW_MAX_PIXELS) -> list[Image.Image]:
    """One preview per output of `req` (its `num_outputs_per_prompt` rows), as large as its final
    images, from the predicted clean latent after its last denoising step. Call it between steps
    (from `Req.on_step`): it reads the request, never changes it."""
    layout = decode_layout(pipeline)
    latents = _vae_latents(layout, req, predicted_clean_latents(req))
    h, w = latents.shape[-2:]
    factor = layout.spatial_factor
    size = (h * factor, w * factor)
    s = pool_factor(*size, max_pixels)
    param = next(layout.vae.parameters())
    latents = latents.to(device=param.device, dtype=param.dtype)
    if s > 1:
        pooled = (max(1, round(h / s)), max(1, round(w / s)))
        flat = latents.squeeze(2) if layout.video_vae else latents
        flat = F.interpolate(flat.float(), size=pooled, mode="area").to(param.dtype)
        latents = flat.unsqueeze(2) if layout.video_vae else flat
    if layout.video_vae:
        latents = denormalize_latents(layout.vae, latents)
        rgb = layout.vae.decode(latents)[:, :, 0]
    else:
        rgb = layout.vae.decode(latents)
    if tuple(rgb.shape[-2:]) != size:
        rgb = F.interpolate(rgb.float(), size=size, mode="bilinear", align_corners=False)
    return tensor_to_pil(rgb)
