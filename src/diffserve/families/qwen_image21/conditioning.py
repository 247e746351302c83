"""Qwen-Image 2.1's condition images (the request's `input_images`), as Diffusers' `QwenImage21Pipeline`
prepares them: each converted to RGBA and resized (Lanczos) to about `resolution`² pixels at its own aspect
ratio, sides rounded to 32; the text encoder reads that copy with its alpha composited over white, the
VAE encodes it (the posterior's mode, then `(z - mean) / std`) into unpatched latent tokens. Where the text
encoder put each image's vision slots is set by the text encoding, per text branch (prompt, negative).

A request without input images has an empty conditioning; requests with and without condition images, or
with different ones, share DiT steps (each row keeps its own prefix)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.models.dits.qwen_image21 import ConditionBlock
from diffserve.request import Conditioning, Req
from diffserve.stages.base import Stage, to_module


def condition_size(image: Image.Image, resolution: int) -> tuple[int, int]:
    """(width, height) with about `resolution`² pixels at the image's aspect ratio, sides rounded to 32
    (Diffusers' `calculate_dimensions`)."""
    ratio = image.width / image.height
    width = math.sqrt(resolution * resolution * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def default_output_size(params: SamplingParams, resolution: int, pixel_multiple: int) -> tuple[int, int]:
    """(height, width) when unset: the last condition image's size, else `resolution` square; floored to
    `pixel_multiple` as Diffusers floors them."""
    if not params.input_images:
        return resolution, resolution
    width, height = condition_size(params.input_images[-1], resolution)
    return height // pixel_multiple * pixel_multiple, width // pixel_multiple * pixel_multiple


def over_white(image: Image.Image) -> Image.Image:
    """An RGBA image's RGB with its alpha composited over white (what the text encoder was trained on)."""
    white = Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


@dataclass
class QwenImage21Conditioning(Conditioning):
    """Empty for a text-to-image request."""

    #: The resized RGB copies the text encoder reads, in order.
    vision_images: list[Image.Image] = field(default_factory=list)
    #: Each image's normalised latent tokens (h * w, channels), row-major over its grid.
    condition_latents: list[torch.Tensor] = field(default_factory=list)
    grids: list[tuple[int, int]] = field(default_factory=list)
    #: Per text branch (prompt, then negative): each image's (first slot, slot count) in its states.
    slots: list[list[tuple[int, int]]] = field(default_factory=list)

    def blocks(self, branch: int) -> list[ConditionBlock]:
        """The DiT's condition blocks of one text branch (empty without condition images)."""
        if not self.condition_latents:
            return []
        return [
            ConditionBlock(slot=start, slots=count, latents=latents, grid=grid)
            for (start, count), latents, grid in zip(
                self.slots[branch], self.condition_latents, self.grids, strict=True
            )
        ]


class QwenImage21ConditionStage(Stage):
    """Resizes and VAE-encodes the request's condition images (nothing without them)."""

    needs = ("params",)
    sets = ("conditioning.vision_images", "conditioning.condition_latents", "conditioning.grids")

    def __init__(self, vae: nn.Module, resolution: int, device: torch.device, dtype: torch.dtype) -> None:
        self.vae = vae
        self.resolution = resolution
        self.device, self.dtype = device, dtype
        self.channels = int(vae.config["in_channels"])
        if self.channels not in (3, 4):
            raise ValueError(f"QwenImage21Pipeline: the VAE reads {self.channels} channels, not RGB(A)")

    def pixels(self, image: Image.Image) -> torch.Tensor:
        """(1, channels, 1, H, W) in [-1, 1]: RGBA for the released four-channel VAE, else RGB over white."""
        source = image if self.channels == 4 else over_white(image)
        array = np.asarray(source, dtype=np.float32) / 255.0
        return (torch.from_numpy(array).permute(2, 0, 1)[None, :, None] * 2.0 - 1.0).contiguous()

    def normalise(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        view = (1, int(config["z_dim"]), 1, 1, 1)
        mean = torch.tensor(config["latents_mean"]).view(view).to(latents.device, latents.dtype)
        std = torch.tensor(config["latents_std"]).view(view).to(latents.device, latents.dtype)
        return (latents - mean) / std

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        conditioning = QwenImage21Conditioning.of(req)
        for original in req.params.input_images or []:
            rgba = original if original.mode == "RGBA" else original.convert("RGBA")
            image = rgba.resize(condition_size(rgba, self.resolution), Image.Resampling.LANCZOS)
            encoded = self.normalise(self.vae.encode(to_module(self.vae, self.pixels(image))).mode())
            _, channels, _, h, w = encoded.shape
            conditioning.vision_images.append(over_white(image))
            conditioning.condition_latents.append(
                encoded.reshape(channels, h * w).transpose(0, 1).to(self.device, self.dtype)
            )
            conditioning.grids.append((h, w))
        return req
