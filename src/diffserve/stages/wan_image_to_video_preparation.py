"""Wan 2.1 image-to-video's "before denoising" stage: the input image's CLIP vision states (cross-
attended), and a conditioning video concatenated to the latents on channels: a mask of the frames the
image covers, then the image and black frames, VAE-encoded and normalised."""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.qwen_image_edit_preparation import image_to_tensor
from diffserve.stages.video_vae_decoding import latent_stats


def image_to_video_size(params: SamplingParams, area: int, multiple: int) -> tuple[int, int]:
    """(height, width) at the input image's aspect ratio with about `area` pixels, sides floored to `multiple`."""
    image = params.input_images[0]
    aspect = image.height / image.width
    height = round((area * aspect) ** 0.5) // multiple * multiple
    width = round((area / aspect) ** 0.5) // multiple * multiple
    return max(height, multiple), max(width, multiple)


def first_frame_mask(batch: int, num_frames: int, latent_frames: int, height: int, width: int, temporal: int):
    """(batch, temporal, latent_frames, height, width): ones where a latent frame holds the input image."""
    mask = torch.zeros(batch, 1, num_frames, height, width)
    mask[:, :, 0] = 1
    mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
    return mask.view(batch, latent_frames, temporal, height, width).transpose(1, 2)


class WanImageToVideoPreparationStage(Stage):
    needs = ("generator",)
    sets = ("image_embeds", "condition_latents")

    def __init__(
        self,
        image_processor,
        image_encoder: nn.Module,
        vae: nn.Module,
        spatial_factor: int,
        temporal_factor: int,
        output_dtype: torch.dtype,
    ) -> None:
        self.image_processor = image_processor
        self.image_encoder = image_encoder
        self.vae = vae
        self.spatial_factor = spatial_factor
        self.temporal_factor = temporal_factor
        self.output_dtype = output_dtype

    @torch.inference_mode()
    def clip_states(self, image: Image.Image) -> torch.Tensor:
        device = next(self.image_encoder.parameters()).device
        inputs = self.image_processor(images=image, return_tensors="pt").to(device)
        return self.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2]

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        n = req.batch_size
        image = p.input_images[0]
        req.image_embeds = self.clip_states(image).repeat(n, 1, 1).to(self.output_dtype)

        resized = image.resize((p.width, p.height), Image.Resampling.LANCZOS)
        frame0 = image_to_tensor(resized).unsqueeze(2)
        video = torch.cat([frame0, frame0.new_zeros(1, 3, p.num_frames - 1, p.height, p.width)], dim=2)
        latents = self.vae.encode(to_module(self.vae, video)).mode().float()
        mean, std = latent_stats(self.vae, latents.device, latents.dtype)
        latents = (latents - mean) * (1.0 / std)  # as Diffusers: times the reciprocal, for identical rounding
        latent_frames, h, w = latents.shape[2:]
        mask = first_frame_mask(1, p.num_frames, latent_frames, h, w, self.temporal_factor).to(latents)
        req.condition_latents = torch.cat([mask, latents], dim=1).repeat(n, 1, 1, 1, 1)
        return req
