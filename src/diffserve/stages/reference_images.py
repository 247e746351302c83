"""`ReferenceImages`: the conditioning of families that edit from input images by appending their tokens
to the noisy image tokens (each row reads [noisy tokens; every reference's tokens], and only the noisy
tokens' prediction is kept). Several unrelated families do this, so its fields are declared once, here,
rather than on `Req` or in each family's package."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from PIL import Image
from torch import nn

from diffserve.request import Conditioning, Req, role
from diffserve.stages.base import to_module
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.latent_preparation import pack_latents


@dataclass
class ReferenceImages(Conditioning):
    """Set by a family's "before denoising" stage; all empty for a request without input images."""

    #: The input images as the family resized them (for a text encoder that reads them too).
    condition_images: list[Image.Image] | None = None
    #: Their packed VAE latents (batch, tokens of every reference, channels), one copy per output,
    #: appended to each row's image tokens: requests in one batch need equal shapes.
    condition_latents: torch.Tensor | None = field(default=None, metadata=role(batch="shape"))
    #: Each reference's (frames, rows, cols) token grid, in order: their position ids, so requests in one
    #: batch need equal grids (equal token counts may come from transposed grids).
    condition_shapes: list[tuple[int, int, int]] = field(default_factory=list, metadata=role(batch="value"))


def set_packed_reference(
    req: Req, vae: nn.Module, image: Image.Image, shown: Image.Image, device: torch.device, dtype: torch.dtype
) -> None:
    """Make `image` (at the size the family chose) the request's one reference: VAE-encoded with its
    posterior's mode, `(z - shift) * scale` (Diffusers' `retrieve_latents` in argmax mode, no generator
    draw), packed into 2x2 latent tokens, one copy per output; `shown` is the picture its text encoder
    reads. The single-image editors (FLUX.1 Kontext, LongCat-Image-Edit) prepare their input this way."""
    scaling = float(vae.config["scaling_factor"])
    shift = float(vae.config.get("shift_factor") or 0.0)
    latents = (vae.encode(to_module(vae, image_to_tensor(image))).mode() - shift) * scaling
    packed = pack_latents(latents).to(device=device, dtype=dtype)
    references = ReferenceImages.of(req)
    references.condition_images = [shown]
    references.condition_latents = packed.repeat(req.batch_size, 1, 1)
    references.condition_shapes = [(1, latents.shape[-2] // 2, latents.shape[-1] // 2)]
