"""Qwen-Image 2.1's condition images (the request's `input_images`), as Diffusers' `QwenImage21Pipeline`
prepares them: each converted to RGBA and resized (Lanczos) to about `resolution`² pixels at its own aspect
ratio (the request's `output_resolution` in `extra`, else the pipeline's 1024), sides rounded to 32; the
text encoder reads that copy with its alpha composited over white, the VAE encodes it (the posterior's mode, then `(z - mean) / std`) into unpatched latent tokens. Where the text
encoder put each image's vision slots is set by the text encoding, per text branch (prompt, negative).

A request without input images has an empty conditioning; requests with and without condition images, or
with different ones, share DiT steps (each row keeps its own prefix)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.qwen_image21.config import output_resolution
from diffserve.loader.processors import QWEN2_VL_MAX_ASPECT_RATIO
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


def vision_pixel_bounds(processor: Any) -> tuple[int, int]:
    """(fewest, most) pixels the processor's image processor keeps an image at (its `size`'s shortest_edge
    and longest_edge, or min_pixels and max_pixels): outside them it resizes the image, and its vision
    slots no longer match the image's latent tokens. A ValueError where the processor says neither."""
    size = getattr(processor.image_processor, "size", None) or {}
    for low, high in (("shortest_edge", "longest_edge"), ("min_pixels", "max_pixels")):
        bounds = (size.get(low), size.get(high))
        if all(isinstance(b, int) for b in bounds):
            return bounds[0], bounds[1]
    raise ValueError(
        "QwenImage21Pipeline: the processor's image processor sets no pixel bounds (size.shortest_edge and "
        "size.longest_edge), which condition images must lie within"
    )


def check_condition_sizes(images: list[Image.Image], resolution: int, vision_pixels: tuple[int, int]) -> None:
    """InvalidRequestError (param "image") for a condition image Diffusers fails on in the middle of the
    request, checked before any model work: its copy resized by `condition_size` has a side of 0 pixels
    (PIL's resize fails), an aspect ratio above `QWEN2_VL_MAX_ASPECT_RATIO` (the processor refuses it), or a
    pixel count outside `vision_pixels` (the processor resizes it, and its vision slots do not match its
    latent tokens)."""
    low, high = vision_pixels
    for index, image in enumerate(images):
        width, height = condition_size(image, resolution)
        what = (
            f"QwenImage21Pipeline: input image {index + 1} ({image.width}x{image.height}), resized to about "
            f"{resolution}x{resolution} pixels at its aspect ratio with sides rounded to 32, would be "
            f"{width}x{height}"
        )
        if width == 0 or height == 0 or max(width, height) > QWEN2_VL_MAX_ASPECT_RATIO * min(width, height):
            raise InvalidRequestError(
                f"{what}: too elongated (the vision encoder takes aspect ratios up to "
                f"{QWEN2_VL_MAX_ASPECT_RATIO}); send an image with a less extreme aspect ratio",
                param="image",
            )
        if not low <= width * height <= high:
            raise InvalidRequestError(
                f"{what}: {width * height} pixels, outside the {low}..{high} pixels the vision encoder's "
                "processor keeps an image at (it would resize it, and the image's vision slots would no longer "
                "match its latents); choose another output_resolution",
                param="image",
            )


def default_output_size(
    params: SamplingParams, resolution: int, pixel_multiple: int, vision_pixels: tuple[int, int]
) -> tuple[int, int]:
    """(height, width) when unset: the last condition image's size, else `resolution` square; floored to
    `pixel_multiple` as Diffusers floors them. Validation calls it on every request (a size given or not),
    so it first checks that every condition image survives its resizing (`check_condition_sizes`)."""
    check_condition_sizes(params.input_images or [], resolution, vision_pixels)
    if not params.input_images:
        side = resolution // pixel_multiple * pixel_multiple
        return side, side
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
        resolution = output_resolution(req.params, self.resolution)
        for original in req.params.input_images or []:
            rgba = original if original.mode == "RGBA" else original.convert("RGBA")
            image = rgba.resize(condition_size(rgba, resolution), Image.Resampling.LANCZOS)
            encoded = self.normalise(self.vae.encode(to_module(self.vae, self.pixels(image))).mode())
            _, channels, _, h, w = encoded.shape
            conditioning.vision_images.append(over_white(image))
            conditioning.condition_latents.append(
                encoded.reshape(channels, h * w).transpose(0, 1).to(self.device, self.dtype)
            )
            conditioning.grids.append((h, w))
        return req
