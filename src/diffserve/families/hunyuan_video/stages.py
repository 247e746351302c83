"""HunyuanVideo's own stages besides text encoding, as Diffusers' `HunyuanVideoPipeline` does each job.

- Timesteps: sigmas linspace(1, 0, steps + 1) without the final 0, through the folder's flow-matching
  scheduler (its static `shift`, 7 for the released folder); with the DiT's guidance embedding, the
  request's `guidance_scale` travels with the schedule (the denoiser multiplies it by 1000).
- Decoding: the latents cast to the VAE's dtype, divided by its `scaling_factor` (no per-channel
  statistics), decoded to uint8 frames (image-to-video's "latent_concat" drops the first decoded frames).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from diffserve.distributed.parallel_vae import decode_split
from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout
from diffserve.stages.timestep_preparation import embedded_guidance, set_schedule
from diffserve.stages.video_vae_decoding import video_to_uint8


class HunyuanVideoTimestepPreparationStage(Stage):
    needs = ("latents",)
    sets = ("schedule",)

    def __init__(self, scheduler, guidance_embeds: bool) -> None:
        refuse_dynamic_shifting_without_mu(scheduler, "HunyuanVideo's pipeline")
        self.scheduler = scheduler
        self.guidance_embeds = guidance_embeds

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        guidance = embedded_guidance(req) if self.guidance_embeds else None
        set_schedule(req, self.scheduler.schedule(steps, sigmas=sigmas), guidance)
        return req


class HunyuanVideoDecodingStage(Stage):
    """(batch, channels, frames, h, w) latents -> one uint8 (frames, H, W, 3) array per output video."""

    needs = ("latents",)
    sets = ("outputs.frames",)

    def __init__(self, vae: nn.Module, dropped_frames: int = 0) -> None:
        self.vae = vae
        self.scaling_factor = float(vae.config["scaling_factor"])
        self.dropped_frames = dropped_frames

    def decode_layout(self) -> DecodeLayout:
        raise NotImplementedError("HunyuanVideo has no step previews yet")

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = to_module(self.vae, req.latents) / self.scaling_factor
        req.outputs.frames = video_to_uint8(decode_split(self.vae, latents)[:, :, self.dropped_frames :])
        return req
