"""FLUX.1 Kontext's input image: its size rule (Diffusers' `_auto_resize`), and the stage that encodes it
once per request into packed VAE latents, which the denoiser appends to the noisy image tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image
from torch import nn

from diffserve.errors import InvalidRequestError
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.latent_preparation import latent_image_ids
from diffserve.stages.reference_images import set_packed_reference


def kontext_condition_size(
    image: Image.Image,
    pixel_multiple: int,
    preferred_resolutions: Sequence[tuple[int, int]],
    auto_resize: bool,
) -> tuple[int, int]:
    """(width, height) the input image is encoded at, as Diffusers' FluxKontextPipeline picks it.

    Its sides are first floored to `pixel_multiple`; with `auto_resize` the preferred (width, height)
    whose aspect ratio is nearest that floored size's is taken (ties: the smaller width); the result is
    floored to `pixel_multiple` again. A width floored to 0 is an aspect ratio of 0 there (the tallest
    preferred size, as Diffusers picks it); a height floored to 0, or without `auto_resize` either side,
    leaves no size (Diffusers fails: a division by zero, an empty resize): InvalidRequestError."""
    width = image.width - image.width % pixel_multiple
    height = image.height - image.height % pixel_multiple
    if height == 0 or (width == 0 and not auto_resize):
        sides = "height" if auto_resize else "width and height"
        raise InvalidRequestError(
            f"the input image is {image.width}x{image.height}: FLUX.1 Kontext floors its {sides} to multiples "
            f"of {pixel_multiple} pixels, which leaves nothing of it; send an image at least {pixel_multiple} "
            f"pixels {'tall' if auto_resize else 'wide and tall'}",
            param="image",
        )
    if auto_resize:
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in preferred_resolutions)
    return width // pixel_multiple * pixel_multiple, height // pixel_multiple * pixel_multiple


def kontext_area_size(height: int, width: int, max_area: int, pixel_multiple: int) -> tuple[int, int]:
    """(height, width) at the aspect ratio of `height` x `width` with about `max_area` pixels, floored to
    `pixel_multiple` (Diffusers' output-size rule; diffserve applies it to the default size only)."""
    aspect = width / height
    fitted_width = round((max_area * aspect) ** 0.5)
    fitted_height = round((max_area / aspect) ** 0.5)
    return fitted_height // pixel_multiple * pixel_multiple, fitted_width // pixel_multiple * pixel_multiple


def kontext_condition_ids(
    grid_height: int, grid_width: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """(h*w, 3) RoPE ids of the input image's packed tokens: the noisy grid's ids with the first axis 1,
    which tells the DiT these tokens are the reference image, not the image being made."""
    ids = latent_image_ids(grid_height, grid_width, device, dtype)
    ids[:, 0] = 1
    return ids


class FluxKontextPreparationStage(Stage):
    """Resizes the request's input image (`kontext_condition_size`), VAE-encodes it (the posterior's
    mode, so no noise is drawn) and packs it into the request's `ReferenceImages`: `condition_latents`
    (batch, tokens, channels), one copy per output, and `condition_shapes` [(1, rows, cols)], its packed grid."""

    needs = ("generator",)
    sets = ("conditioning.condition_images", "conditioning.condition_latents")

    def __init__(
        self,
        vae: nn.Module,
        pixel_multiple: int,
        preferred_resolutions: Sequence[tuple[int, int]],
        auto_resize: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.vae = vae
        self.pixel_multiple = pixel_multiple
        self.preferred_resolutions = tuple(preferred_resolutions)
        self.auto_resize = auto_resize
        self.device = device
        self.dtype = dtype

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        (original,) = req.params.input_images
        size = kontext_condition_size(
            original, self.pixel_multiple, self.preferred_resolutions, self.auto_resize
        )
        image = original.resize(size, Image.Resampling.LANCZOS)
        set_packed_reference(req, self.vae, image, image, self.device, self.dtype)
        return req
