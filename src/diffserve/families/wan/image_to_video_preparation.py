"""Wan image-to-video's "before denoising" stage: the input image's CLIP vision states (cross-attended;
Wan 2.1 only, Wan 2.2 A14B has no image encoder), and a conditioning video concatenated to the latents
on channels: a mask of the frames the image covers, then the image and black frames, VAE-encoded and
normalised. A second input image is the clip's last frame (Diffusers' `last_image`, `last_image.py`): it
ends the conditioning video, the mask marks it too, and its CLIP states follow the first image's."""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.families.wan.conditioning import WanConditioning
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.video_vae_decoding import latent_stats


def image_to_video_size(params: SamplingParams, area: int, multiple: int) -> tuple[int, int]:
    """(height, width) at the input image's aspect ratio with about `area` pixels, sides floored to `multiple`."""
    image = params.input_images[0]
    aspect = image.height / image.width
    height = round((area * aspect) ** 0.5) // multiple * multiple
    width = round((area / aspect) ** 0.5) // multiple * multiple
    return max(height, multiple), max(width, multiple)


def resized_frame(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """The input image resized (Lanczos, as Diffusers' video processor) to one frame (1, 3, 1, H, W) in [-1, 1]."""
    resized = image.resize((width, height), Image.Resampling.LANCZOS)
    return image_to_tensor(resized).unsqueeze(2)


def first_frame_mask(
    batch: int,
    num_frames: int,
    latent_frames: int,
    height: int,
    width: int,
    temporal: int,
    last_frame: bool = False,
) -> torch.Tensor:
    """(batch, temporal, latent_frames, height, width): ones where a latent frame holds a given frame (the
    first; with `last_frame` the last one too)."""
    mask = torch.zeros(batch, 1, num_frames, height, width)
    mask[:, :, 0] = 1
    if last_frame:
        mask[:, :, -1] = 1
    mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
    return mask.view(batch, latent_frames, temporal, height, width).transpose(1, 2)


def encode_condition(vae: nn.Module, video: torch.Tensor) -> torch.Tensor:
    """A pixel video (1, 3, T, H, W) in [-1, 1] -> its normalised VAE latents (posterior mode), float32."""
    latents = vae.encode(to_module(vae, video)).mode().float()
    mean, std = latent_stats(vae, latents.device, latents.dtype)
    return (latents - mean) * (1.0 / std)  # as Diffusers: times the reciprocal, for identical rounding


class WanImageToVideoPreparationStage(Stage):
    """Sets `image_embeds` too, but only with an `image_encoder`: None (Wan 2.2 A14B, whose DiT has no
    image cross-attention) leaves it unset. Both are repeated for every output video: Diffusers repeats the
    CLIP states once per prompt only, so its Wan 2.1 I2V (and SkyReels-V2 I2V) fails with
    `num_videos_per_prompt` > 1, which this serves."""

    needs = ("generator",)
    sets = ("conditioning.condition_latents",)

    def __init__(
        self,
        image_processor,
        image_encoder: nn.Module | None,
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
    def clip_states(self, images: Image.Image | list[Image.Image]) -> torch.Tensor:
        """(1, tokens, dim): the penultimate CLIP states of the image, or of the first and last frames one
        after the other (encoded as one batch, as Diffusers encodes `[image, last_image]`)."""
        device = next(self.image_encoder.parameters()).device
        inputs = self.image_processor(images=images, return_tensors="pt").to(device)
        states = self.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2]
        return states.reshape(1, -1, states.shape[-1])

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        n = req.batch_size
        image, *rest = p.input_images
        last = rest[0] if rest else None
        conditioning = WanConditioning.of(req)
        if self.image_encoder is not None:
            clip_input = image if last is None else [image, last]
            conditioning.image_embeds = self.clip_states(clip_input).repeat(n, 1, 1).to(self.output_dtype)

        frame0 = resized_frame(image, p.height, p.width)
        black = p.num_frames - (1 if last is None else 2)
        frames = [frame0, frame0.new_zeros(1, 3, black, p.height, p.width)]
        if last is not None:
            frames.append(resized_frame(last, p.height, p.width))
        latents = encode_condition(self.vae, torch.cat(frames, dim=2))
        latent_frames, h, w = latents.shape[2:]
        mask = first_frame_mask(
            1, p.num_frames, latent_frames, h, w, self.temporal_factor, last_frame=last is not None
        ).to(latents)
        conditioning.condition_latents = torch.cat([mask, latents], dim=1).repeat(n, 1, 1, 1, 1)
        return req
