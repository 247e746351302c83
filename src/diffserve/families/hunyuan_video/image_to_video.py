"""HunyuanVideo image-to-video's own stages and denoising step, as Diffusers'
`HunyuanVideoImageToVideoPipeline` does each job:

- Image latents: the input image resized (Lanczos) to the output size, VAE-encoded (the posterior's mode),
  in float32 times the VAE's `scaling_factor`, repeated over the latent frames; the initial latents are
  `noise * 0.999 + image_latents * 0.001` (float32). "token_replace" keeps the first frame of the image
  latents; "latent_concat" zeroes the frames after the first and adds a mask of ones on the first.
- The DiT's input: "token_replace" puts the image latents in place of the first frame (and the Euler step
  advances the other frames only, the first staying the image's: Diffusers' concatenation leaves the
  latents in float32); "latent_concat" concatenates [latents; image latents; mask] on channels and steps
  all frames.
- Decoding: "latent_concat" drops the first 4 decoded frames.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from diffserve.families.hunyuan_video.conditioning import HunyuanVideoImageConditioning
from diffserve.families.hunyuan_video.pipeline import HunyuanVideoDenoiser
from diffserve.pipelines.cfg_batch import advance_requests
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.image_tensor import image_to_tensor


class HunyuanVideoImageLatentsStage(Stage):
    """After the noise is drawn: mixes in the input image's latents and keeps them for the DiT's inputs."""

    needs = ("latents",)
    sets = ("latents", "conditioning.image_latents")

    def __init__(self, vae: nn.Module, token_replace: bool, noise_keep: float) -> None:
        self.vae = vae
        self.token_replace = token_replace
        self.noise_keep = noise_keep
        self.scaling_factor = float(vae.config["scaling_factor"])

    @torch.inference_mode()
    def encode(self, image: Image.Image, height: int, width: int) -> torch.Tensor:
        """The image as one latent frame (1, C, 1, h, w), float32 times the scaling factor."""
        frame = image_to_tensor(image.resize((width, height), Image.Resampling.LANCZOS)).unsqueeze(2)
        return self.vae.encode(to_module(self.vae, frame)).mode().float() * self.scaling_factor

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        noise = req.latents
        image = self.encode(p.input_images[0], p.height, p.width).to(noise.device)
        image = image.repeat(1, 1, noise.shape[2], 1, 1)
        keep = torch.tensor([self.noise_keep], device=noise.device)
        req.latents = noise * keep + image * (1 - keep)
        rows = noise.shape[0]
        if self.token_replace:
            condition = image[:, :, :1]
        else:
            image[:, :, 1:] = 0
            mask = image.new_zeros(1, 1, *image.shape[2:])
            mask[:, :, 0] = 1
            condition = torch.cat([image, mask], dim=1)
        HunyuanVideoImageConditioning.of(req).image_latents = condition.expand(rows, -1, -1, -1, -1).clone()
        return req


class HunyuanVideoImageToVideoDenoiser(HunyuanVideoDenoiser):
    """The text-to-video step with the image latents in the DiT's input (see the module docstring)."""

    def __init__(self, *args, token_replace: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_replace = token_replace

    def model_input(self, req: Req) -> torch.Tensor:
        image = HunyuanVideoImageConditioning.of(req).image_latents
        if self.token_replace:
            return torch.cat([image, req.latents[:, :, 1:]], dim=2)
        return torch.cat([req.latents, image], dim=1)

    def advance(self, reqs: list[Req], predictions: list[torch.Tensor]) -> None:
        if not self.token_replace:
            super().advance(reqs, predictions)
            return
        for req in reqs:
            req.latents = req.latents[:, :, 1:]
        advance_requests(self.scheduler, reqs, [prediction[:, :, 1:] for prediction in predictions])
        for req in reqs:
            req.latents = torch.cat([HunyuanVideoImageConditioning.of(req).image_latents, req.latents], dim=2)
