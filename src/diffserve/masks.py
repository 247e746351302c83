"""Inpainting masks as users send them, turned into the one form the pipelines read.

Two conventions are accepted:

- OpenAI's (`client.images.edit(image=..., mask=...)`): a mask with an alpha channel whose fully
  transparent pixels (alpha = 0) mark the area to edit; every other pixel is kept. Its colours are ignored.
- Diffusers': a black-and-white (or grey) mask without alpha, white = edit, black = keep.

A mask that has an alpha channel but no fully transparent pixel (an opaque RGBA PNG) is read by its
luminance, as Diffusers reads it. `edit_mask` gives an "L" image, 255 where the request edits;
`pipeline_mask` what the pipelines resize, convert to "L" and binarize at 0.5, in that order, as Diffusers'
mask processor does (`stages/mask_preparation.py`): a luminance mask in the mode it was sent in.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from diffserve.errors import InvalidRequestError

#: PIL modes with an alpha channel, and the palette mode, whose transparency is a separate setting.
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def has_alpha(image: Image.Image) -> bool:
    """Whether `image` carries per-pixel transparency (an alpha band, or a palette's transparency)."""
    return image.mode in _ALPHA_MODES or "transparency" in image.info


def _transparent_area(mask: Image.Image) -> Image.Image | None:
    """The "L" edit mask of the transparency convention (255 where alpha is 0), or None when `mask` has no
    fully transparent pixel (it is read by its luminance)."""
    if not has_alpha(mask):
        return None
    alpha = np.asarray(mask.convert("RGBA"))[..., 3]
    if not (alpha == 0).any():
        return None
    return Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), mode="L")


def edit_mask(mask: Image.Image) -> Image.Image:
    """`mask` in either convention as an "L" image, 255 where the request edits (see the module doc)."""
    area = _transparent_area(mask)
    return mask.convert("L") if area is None else area


def pipeline_mask(mask: Image.Image) -> Image.Image:
    """`mask` as the pipelines read it (`stages.mask_preparation.mask_pixels`: resized, then converted to
    "L" and binarized): in the transparency convention `edit_mask`'s "L" image; otherwise the mask as sent,
    in its own mode. Diffusers' mask processor resizes a mask in its own mode and converts it to grayscale
    after: PIL resizes "1" and "P" images nearest-neighbour whatever filter is asked, and an RGB mask's
    Lanczos rounds differently from its luminance's, so converting first would change the edited area."""
    area = _transparent_area(mask)
    return mask if area is None else area


def check_mask_size(mask: Image.Image, image: Image.Image) -> None:
    """InvalidRequestError (param "mask") unless the mask has the input image's size: a mask marks pixels
    of that image, and stretching a mask of another size would move the edited area."""
    if mask.size != image.size:
        raise InvalidRequestError(
            f"mask is {mask.width}x{mask.height} but the image is {image.width}x{image.height}; send a mask "
            "of the input image's size",
            param="mask",
        )
