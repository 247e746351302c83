"""HunyuanVideo 1.5's noise and conditioning inputs.

The DiT reads, concatenated on channels, the noisy latents, condition latents and a one-channel mask of
the latent frames they fill. Text-to-video fills none (zeros). Image-to-video puts the input image's VAE
latents (posterior mode, times the VAE's scaling factor) in the first latent frame, and its SigLIP
states become image tokens the DiT attends to; the image is first scaled and centre-cropped to the
output size, as Diffusers does.

What a request carries for this (its text masks, the ByT5 glyph states, the condition latents and image
states) is `HunyuanVideo15Conditioning`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from diffserve.families.hunyuan_video15.sizes import resize_and_crop
from diffserve.request import Req, role
from diffserve.stages.base import Stage, to_module
from diffserve.stages.glyph_text_encoding import GlyphTextConditioning
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.latent_preparation import VideoLatentPreparationStage


@dataclass
class HunyuanVideo15Conditioning(GlyphTextConditioning):
    """HunyuanVideo 1.5's per-request inputs beyond `Req`. Its DiT reads fixed-length padded text with its
    mask, so each text branch has (batch, seq) masks of `Req.prompt_embeds` and a second encoder's
    sequence states with their masks (ByT5's states of the prompt's quoted text: `GlyphTextConditioning`)."""

    #: (batch, channels + 1, frames, h, w): condition latents and the mask of the frames they fill,
    #: concatenated with the noisy latents on channels (zeros for text-to-video).
    condition_latents: torch.Tensor | None = field(default=None, metadata=role(batch="shape"))
    #: Image-to-video: the input image's SigLIP states (batch, tokens, dim), the DiT's image tokens.
    image_embeds: torch.Tensor | None = field(default=None, metadata=role(batch="shape"))


class HunyuanVideo15LatentPreparationStage(VideoLatentPreparationStage):
    """Initial noise (batch, channels, latent frames, h, w) in the DiT's dtype (Diffusers draws it in that
    dtype), from the request's CPU generator."""


class HunyuanVideo15EmptyConditionStage(Stage):
    """Text-to-video: zero condition latents and mask, (batch, channels + 1, frames, h, w)."""

    needs = ("latents",)
    sets = ("conditioning.condition_latents",)

    def forward(self, req: Req) -> Req:
        b, c, f, h, w = req.latents.shape
        HunyuanVideo15Conditioning.of(req).condition_latents = req.latents.new_zeros(b, c + 1, f, h, w)
        return req


class HunyuanVideo15ImageConditionStage(Stage):
    """Image-to-video: the input image's SigLIP states (`image_embeds`) and its first-frame condition
    latents with their mask (`condition_latents`), one copy per output."""

    needs = ("latents",)
    sets = ("conditioning.condition_latents", "conditioning.image_embeds")

    def __init__(
        self, feature_extractor, image_encoder: nn.Module, vae: nn.Module, output_dtype: torch.dtype
    ) -> None:
        self.feature_extractor = feature_extractor
        self.image_encoder = image_encoder
        self.vae = vae
        self.output_dtype = output_dtype

    @torch.inference_mode()
    def image_states(self, image) -> torch.Tensor:
        """SigLIP's last hidden states (1, tokens, dim) of the cropped input image."""
        inputs = self.feature_extractor.preprocess(
            images=image, do_resize=True, return_tensors="pt", do_convert_rgb=True
        )
        pixels = to_module(self.image_encoder, inputs["pixel_values"])
        return self.image_encoder(pixel_values=pixels).last_hidden_state

    @torch.inference_mode()
    def image_latents(self, image) -> torch.Tensor:
        """The cropped image as one frame through the VAE: posterior mode times the scaling factor."""
        frame = to_module(self.vae, image_to_tensor(image).unsqueeze(2))
        return self.vae.encode(frame).mode() * self.vae.config["scaling_factor"]

    def forward(self, req: Req) -> Req:
        p = req.params
        image = resize_and_crop(p.input_images[0], p.height, p.width)
        n = req.batch_size
        conditioning = HunyuanVideo15Conditioning.of(req)
        conditioning.image_embeds = self.image_states(image).repeat(n, 1, 1).to(self.output_dtype)
        latents = req.latents
        condition = latents.new_zeros(latents.shape[0], latents.shape[1] + 1, *latents.shape[2:])
        first = self.image_latents(image).to(device=latents.device, dtype=latents.dtype)
        condition[:, :-1, :1] = first
        condition[:, -1:, :1] = 1.0
        conditioning.condition_latents = condition
        return req
