"""Converting between ComfyUI's tensors and the files the server sends and takes.

ComfyUI's IMAGE is a float32 tensor B x H x W x C in 0..1 (C = 3, sometimes 4), its MASK a float tensor
B x H x W (or H x W) in 0..1 where 1 marks the area to edit. The server sends and takes PNGs; its masks
follow OpenAI's convention, transparent pixels (alpha 0) mark the area to edit.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

#: A mask value at or above this edits the pixel: the server binarizes masks at 0.5 too.
MASK_THRESHOLD = 0.5


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """One ComfyUI image (H x W x C, 0..1) as H x W x 3 uint8, rounded; an alpha channel is dropped."""
    if image.ndim != 3 or image.shape[-1] not in (3, 4):
        raise ValueError(f"expected one image of shape H x W x 3 (or 4), got {tuple(image.shape)}")
    pixels = image[..., :3].detach().to("cpu", torch.float32).clamp(0, 1).mul(255).round()
    return pixels.to(torch.uint8).numpy()


def png_bytes(pixels: np.ndarray, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buffer, format="PNG")
    return buffer.getvalue()


def image_png(image: torch.Tensor) -> bytes:
    """One ComfyUI image (H x W x C) as an RGB PNG."""
    return png_bytes(to_uint8(image))


def image_data_url(image: torch.Tensor) -> str:
    """One ComfyUI image as a `data:image/png;base64,...` URL (how JSON bodies carry images)."""
    return "data:image/png;base64," + base64.b64encode(image_png(image)).decode("ascii")


def mask_png(mask: torch.Tensor) -> bytes:
    """One ComfyUI mask (H x W, 1 = edit) as the RGBA PNG the server takes: alpha 0 where the mask is at
    least MASK_THRESHOLD (edit), 255 elsewhere (keep). Its colour is white where it edits and black
    where it keeps, so a reader of luminance (diffusers' convention, white = edit) sees the same area."""
    if mask.ndim != 2:
        raise ValueError(f"expected one mask of shape H x W, got {tuple(mask.shape)}")
    edit = (mask.detach().to("cpu", torch.float32) >= MASK_THRESHOLD).numpy()
    rgba = np.empty((*edit.shape, 4), dtype=np.uint8)
    rgba[..., :3] = np.where(edit, 255, 0)[..., None]
    rgba[..., 3] = np.where(edit, 0, 255)
    return png_bytes(rgba, mode="RGBA")


def mask_data_url(mask: torch.Tensor) -> str:
    """One ComfyUI mask (H x W, 1 = edit) as a `data:image/png;base64,...` URL of `mask_png`'s PNG (how
    JSON bodies carry masks: a ControlNet entry's `mask`)."""
    return "data:image/png;base64," + base64.b64encode(mask_png(mask)).decode("ascii")


def decode_image(data: bytes) -> torch.Tensor:
    """An image file's bytes as H x W x 3 float32 in 0..1 (the uint8 levels / 255)."""
    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(pixels / 255.0)


def decode_b64_images(data: list[dict]) -> list[torch.Tensor]:
    """The images of an images response's `data` (its `b64_json` entries)."""
    images = []
    for i, item in enumerate(data):
        if not item.get("b64_json"):
            raise ValueError(f"the server's image {i} has no b64_json (the nodes ask for b64_json)")
        images.append(decode_image(base64.b64decode(item["b64_json"])))
    return images


def stack(images: list[torch.Tensor]) -> torch.Tensor:
    """H x W x 3 images as one B x H x W x 3 batch; ComfyUI batches need one size."""
    sizes = sorted({(img.shape[1], img.shape[0]) for img in images})
    if len(sizes) > 1:
        listed = ", ".join(f"{w}x{h}" for w, h in sizes)
        raise ValueError(
            f"the server returned images of different sizes ({listed}); one batch needs one size"
        )
    return torch.stack(images)


def masks_for(mask: torch.Tensor, count: int, height: int, width: int) -> list[torch.Tensor]:
    """`count` H x W masks from a ComfyUI MASK (B x H x W or H x W): one per image, or one for all;
    each must have the images' size (a mask marks pixels of its image)."""
    masks = mask[None] if mask.ndim == 2 else mask
    if masks.ndim != 3:
        raise ValueError(f"expected a mask of shape B x H x W, got {tuple(mask.shape)}")
    if tuple(masks.shape[1:]) != (height, width):
        raise ValueError(
            f"the mask is {masks.shape[2]}x{masks.shape[1]} but the image is {width}x{height}; a mask must "
            "have its image's size"
        )
    if masks.shape[0] == 1:
        return [masks[0]] * count
    if masks.shape[0] != count:
        raise ValueError(f"{masks.shape[0]} masks for {count} images; pass one mask, or one per image")
    return list(masks)
