"""`ReferenceImages`: the conditioning of families that edit from input images by appending their tokens
to the noisy image tokens (each row reads [noisy tokens; every reference's tokens], and only the noisy
tokens' prediction is kept). Several unrelated families do this, so its fields are declared once, here,
rather than on `Req` or in each family's package."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from PIL import Image

from diffserve.request import Conditioning, role


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
