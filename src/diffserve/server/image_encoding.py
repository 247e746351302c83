"""PIL image -> PNG/JPEG/WEBP bytes, and the files behind `response_format="url"`."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

from PIL import Image, PngImagePlugin

CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}

#: Image ids are `{request id (32 hex)}-{index}`; anything else is refused before touching the disk.
IMAGE_ID_PATTERN = re.compile(r"^[0-9a-f]{32}-[0-9]{1,2}$")


def encode_image(
    image: Image.Image, output_format: str, quality: int | None = None, metadata: dict[str, Any] | None = None
) -> bytes:
    """Encode one image. `quality` (0-100) applies to jpeg and webp (None: 100, as OpenAI's default);
    PNGs carry `metadata` as JSON in a `parameters` text chunk, like `diffserve generate`'s files."""
    buffer = io.BytesIO()
    if output_format == "png":
        info = PngImagePlugin.PngInfo()
        if metadata:
            info.add_text("parameters", json.dumps(metadata, sort_keys=True, default=str))
        image.save(buffer, format="PNG", pnginfo=info)
    elif output_format in ("jpeg", "webp"):
        image.convert("RGB").save(buffer, format=output_format.upper(), quality=100 if quality is None else quality)
    else:
        raise ValueError(f"unknown output format {output_format!r}")
    return buffer.getvalue()


def image_path(output_dir: Path, image_id: str, output_format: str) -> Path:
    return output_dir / f"{image_id}.{output_format}"


def find_image(output_dir: Path, image_id: str) -> Path | None:
    """The stored file of `image_id` (any format), or None. Ids that are not well-formed never match."""
    if not IMAGE_ID_PATTERN.match(image_id):
        return None
    for output_format in CONTENT_TYPES:
        path = image_path(output_dir, image_id, output_format)
        if path.is_file():
            return path
    return None
