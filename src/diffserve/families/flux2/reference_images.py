"""FLUX.2's reference images (multi-reference editing), as Diffusers' Flux2Pipeline / Flux2KleinPipeline
prepare them: each image is checked (sides >= 64 px, aspect ratio <= 8), shrunk to about 1 MP when larger,
centre-cropped to the pixel multiple, VAE-encoded (the posterior's mode), patchified, normalised with the
VAE's `bn` statistics and flattened into tokens. The denoiser appends every reference's tokens, in
order, after the noisy tokens; reference i's ids carry the time coordinate 10 * (i + 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.flux2.latent_preparation import flux2_grid_ids, tokens_from_grid
from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.input_validation import ImageInputRule
from diffserve.stages.reference_images import ReferenceImages


@dataclass(frozen=True)
class Flux2ImageInputRule(ImageInputRule):
    """Diffusers' `Flux2ImageProcessor.check_image_input` on top of the count rule: both sides at least
    `min_side` pixels, aspect ratio at most `max_aspect_ratio`."""

    min_side: int = 64
    max_aspect_ratio: float = 8.0

    def check(self, params: SamplingParams) -> None:
        super().check(params)
        for index, image in enumerate(params.input_images or []):
            width, height = image.size
            if width < self.min_side or height < self.min_side:
                raise InvalidRequestError(
                    f"input image {index} is {width}x{height}; {self.pipeline_name} needs both sides at least "
                    f"{self.min_side} pixels",
                    param="image",
                )
            ratio = max(width / height, height / width)
            if ratio > self.max_aspect_ratio:
                raise InvalidRequestError(
                    f"input image {index} is {width}x{height} (aspect ratio {ratio:.1f}:1); {self.pipeline_name} "
                    f"takes at most {self.max_aspect_ratio:g}:1",
                    param="image",
                )


def reference_image(image: Image.Image, pixel_multiple: int, max_area: int) -> Image.Image:
    """The picture the VAE encodes: resized (Lanczos) to about `max_area` pixels at its aspect ratio when
    larger (sides truncated, as Diffusers' `_resize_to_target_area`), then centre-cropped to sides that
    are multiples of `pixel_multiple` (Diffusers' `preprocess(..., resize_mode="crop")`), in RGB."""
    width, height = image.size
    if width * height > max_area:
        scale = math.sqrt(max_area / (width * height))
        image = image.resize((int(width * scale), int(height * scale)), Image.Resampling.LANCZOS)
        width, height = image.size
    crop_width = width // pixel_multiple * pixel_multiple
    crop_height = height // pixel_multiple * pixel_multiple
    left, top = (width - crop_width) // 2, (height - crop_height) // 2
    return image.crop((left, top, left + crop_width, top + crop_height)).convert("RGB")


def reference_ids(
    shapes: list[tuple[int, int, int]], time_offset: int, device: torch.device
) -> list[torch.Tensor]:
    """Each reference grid's (rows * cols, 4) ids, reference i at time `time_offset * (i + 1)`."""
    return [
        flux2_grid_ids(rows, cols, time_offset * (i + 1), device) for i, (_, rows, cols) in enumerate(shapes)
    ]


class Flux2ReferenceImageStage(Stage):
    """Sets the request's `ReferenceImages`: `condition_images` (the cropped pictures; empty without input
    images) and, with images, `condition_latents` (batch, tokens of all references, 4 * latent_channels),
    one copy per output, and `condition_shapes` [(1, rows, cols)] per reference."""

    sets = ("conditioning.condition_images",)  # condition_latents stays None for text-to-image

    def __init__(
        self,
        vae: AutoencoderKLFlux2,
        pixel_multiple: int,
        max_area: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.vae = vae
        self.pixel_multiple = pixel_multiple
        self.max_area = max_area
        self.device = device
        self.dtype = dtype

    @torch.inference_mode()
    def encode(self, image: Image.Image) -> torch.Tensor:
        """(1, C, rows, cols): the image's patchified, `bn`-normalised latents."""
        pixels = to_module(self.vae, image_to_tensor(image))
        return self.vae.normalize_latents(self.vae.patchify(self.vae.encode(pixels).mode()))

    def forward(self, req: Req) -> Req:
        images = [
            reference_image(image, self.pixel_multiple, self.max_area)
            for image in req.params.input_images or []
        ]
        references = ReferenceImages.of(req)
        references.condition_images = images
        if not images:
            return req
        grids = [self.encode(image) for image in images]
        tokens = torch.cat([tokens_from_grid(grid) for grid in grids], dim=1)
        references.condition_latents = tokens.to(device=self.device, dtype=self.dtype).repeat(
            req.batch_size, 1, 1
        )
        references.condition_shapes = [(1, grid.shape[-2], grid.shape[-1]) for grid in grids]
        return req


def reference_default_size(
    params: SamplingParams, pixel_multiple: int, max_area: int, default_pixels: int
) -> tuple[int, int]:
    """(height, width) when the request leaves them unset: the first reference image's cropped size, else
    `default_pixels` square (Diffusers' rule)."""
    if not params.input_images:
        return default_pixels, default_pixels
    width, height = params.input_images[0].size
    if width * height > max_area:
        scale = math.sqrt(max_area / (width * height))
        width, height = int(width * scale), int(height * scale)
    return height // pixel_multiple * pixel_multiple, width // pixel_multiple * pixel_multiple
