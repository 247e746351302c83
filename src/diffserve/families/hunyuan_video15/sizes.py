"""HunyuanVideo 1.5's output sizes: buckets of about `target_size`**2 pixels (the DiT's config) with sides
in multiples of the VAE's spatial factor, and the bucket whose aspect ratio is closest to a requested one
without crossing it towards square (Diffusers' `HunyuanVideo15ImageProcessor.calculate_default_height_width`).
Image-to-video crops its input image to the chosen size (`resize_and_crop`)."""

from __future__ import annotations

from PIL import Image


def size_buckets(target_size: int, multiple: int, max_aspect_ratio: float) -> list[tuple[int, int]]:
    """(height, width) buckets of about (target_size / multiple)**2 cells of `multiple` pixels, from the
    tallest to the widest, aspect ratios within `max_aspect_ratio`."""
    cells = round((target_size / multiple) ** 2)
    buckets = []
    rows, cols = cells, 1
    while rows > 0:
        if max(rows, cols) / min(rows, cols) <= max_aspect_ratio:
            buckets.append((rows * multiple, cols * multiple))
        if (cols + 1) * rows <= cells:
            cols += 1
        else:
            rows -= 1
    return buckets


def closest_bucket(height: float, width: float, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose height/width ratio (rounded to 5 decimals) is closest to `height / width`, taken
    among the buckets no more square than the request (a tie goes to the first)."""
    aspect = float(height) / float(width)
    gaps = [round(float(h) / float(w), 5) - aspect for h, w in buckets]
    candidates = [(i, gap) for i, gap in enumerate(gaps) if (gap <= 0 if aspect >= 1 else gap >= 0)]
    best = min(candidates, key=lambda pair: abs(pair[1]))[0]
    return buckets[best]


def resize_and_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """`image` scaled (Lanczos) to cover height x width at its own aspect ratio, then centre-cropped to it
    (Diffusers' `resize_mode="crop"`, including its integer rounding)."""
    wider = width / height > image.width / image.height
    scaled_w = width if wider else image.width * height // image.height
    scaled_h = height if not wider else image.height * width // image.width
    scaled = image.resize((scaled_w, scaled_h), resample=Image.Resampling.LANCZOS)
    out = Image.new("RGB", (width, height))
    out.paste(scaled, box=(width // 2 - scaled_w // 2, height // 2 - scaled_h // 2))
    return out
