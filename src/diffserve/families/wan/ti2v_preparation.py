"""Wan 2.2 TI2V's "before denoising" stage (`expand_timesteps` folders): with an input image, its VAE
latents as the clip's first latent frame. The denoiser puts them in place of the noisy first frame at
every step, with timestep 0 for that frame's tokens, and in the final latents (Diffusers'
`WanImageToVideoPipeline` with `expand_timesteps`). Without an image the request is text-to-video."""

from __future__ import annotations

import torch
from torch import nn

from diffserve.families.wan.conditioning import WanConditioning
from diffserve.families.wan.image_to_video_preparation import encode_condition, resized_frame
from diffserve.request import Req
from diffserve.stages.base import Stage


class WanFirstFrameLatentStage(Stage):
    """Sets `conditioning.condition_latents` (batch, channels, 1, h, w) for a request with an input image only."""

    sets = ()

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        if not p.input_images:
            return req
        frame = resized_frame(p.input_images[0], p.height, p.width)
        # (1, channels, 1, h, w): the image is encoded alone, as one frame.
        WanConditioning.of(req).condition_latents = encode_condition(self.vae, frame).repeat(
            req.batch_size, 1, 1, 1, 1
        )
        return req
