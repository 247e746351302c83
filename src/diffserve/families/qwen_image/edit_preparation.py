"""Qwen-Image-Edit's "before denoising" stage: each input image resized to about `condition_image_area`
pixels (as Diffusers), kept for the text encoder, and VAE-encoded into packed latents that the denoiser
appends to the image tokens."""

from __future__ import annotations

import math

import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.loader.processors import QWEN2_VL_MAX_ASPECT_RATIO
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.latent_preparation import pack_latents
from diffserve.stages.reference_images import ReferenceImages
from diffserve.stages.video_vae_decoding import normalize_latents


def condition_size(image: Image.Image, area: int) -> tuple[int, int]:
    """(width, height) with about `area` pixels at the image's aspect ratio, sides multiples of 32."""
    ratio = image.width / image.height
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def check_condition_sizes(
    images: list[Image.Image], areas: tuple[int, ...], pipeline_name: str, vision_area: int | None = None
) -> None:
    """InvalidRequestError (param "image") for an input image that Diffusers fails on in the middle of the
    request, checked before any model work: one so elongated that `condition_size` gives it a side of 0
    pixels at one of `areas` (PIL's resize fails), or whose copy for the vision-language encoder (resized
    to `vision_area`; None: the encoder reads no image) is more than `QWEN2_VL_MAX_ASPECT_RATIO` times longer
    than wide (the processor refuses it)."""
    for index, image in enumerate(images):
        what = f"{pipeline_name}: input image {index + 1} ({image.width}x{image.height}) is too elongated"
        for area in areas:
            width, height = condition_size(image, area)
            if width == 0 or height == 0:
                raise InvalidRequestError(
                    f"{what}: resized to about {area} pixels at its aspect ratio, with sides rounded to 32, it "
                    f"would be {width}x{height}; send an image with a less extreme aspect ratio",
                    param="image",
                )
        if vision_area is not None:
            width, height = condition_size(image, vision_area)
            if max(width, height) > QWEN2_VL_MAX_ASPECT_RATIO * min(width, height):
                raise InvalidRequestError(
                    f"{what}: the vision encoder's copy ({width}x{height}) has an aspect ratio above "
                    f"{QWEN2_VL_MAX_ASPECT_RATIO}, which its processor refuses; send an image with a less "
                    "extreme aspect ratio",
                    param="image",
                )


def edit_output_size(params: SamplingParams, area: int, pixel_multiple: int) -> tuple[int, int]:
    """Default (height, width) of an edit: the last input image's condition size, floored to the pixel multiple."""
    width, height = condition_size(params.input_images[-1], area)
    return height // pixel_multiple * pixel_multiple, width // pixel_multiple * pixel_multiple


class QwenImageEditPreparationStage(Stage):
    needs = ("generator",)
    sets = ("conditioning.condition_images", "conditioning.condition_latents")

    def __init__(
        self, vae: nn.Module, condition_image_area: int, vision_image_area: int | None = None
    ) -> None:
        """`vision_image_area`: size of the copy the text encoder reads (Edit-Plus); None: the VAE's copy."""
        self.vae = vae
        self.condition_image_area = condition_image_area
        self.vision_image_area = vision_image_area

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        resized, latents, shapes = [], [], []
        for original in req.params.input_images:
            image = original.resize(
                condition_size(original, self.condition_image_area), Image.Resampling.LANCZOS
            )
            if self.vision_image_area is None:
                resized.append(image)
            else:
                size = condition_size(original, self.vision_image_area)
                resized.append(original.resize(size, Image.Resampling.LANCZOS))
            pixels = to_module(self.vae, image_to_tensor(image).unsqueeze(2))
            encoded = normalize_latents(self.vae, self.vae.encode(pixels).mode())[:, :, 0]
            latents.append(pack_latents(encoded))
            shapes.append((1, encoded.shape[-2] // 2, encoded.shape[-1] // 2))
        references = ReferenceImages.of(req)
        references.condition_images = resized
        references.condition_latents = torch.cat(latents, dim=1).repeat(req.batch_size, 1, 1)
        references.condition_shapes = shapes
        return req
