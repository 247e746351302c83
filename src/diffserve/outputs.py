"""Writing generated images: collision-free file names and generation parameters in PNG text chunks."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from PIL import Image, PngImagePlugin

_SLUG_MAX = 60


def prompt_slug(prompt: str) -> str:
    """A file-name-safe slug of the prompt ("A red fox!" -> "A_red_fox")."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")
    return slug[:_SLUG_MAX].rstrip("_") or "image"


def output_file_name(prompt: str, request_id: str, index: int, extension: str) -> str:
    """`{prompt slug}_{YYYYmmdd-HHMMSS}_{hash8}.{ext}`; the hash covers request id and output index."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    digest = hashlib.sha256(f"{request_id}:{index}:{prompt}".encode()).hexdigest()[:8]
    return f"{prompt_slug(prompt)}_{stamp}_{digest}.{extension}"


def unique_path(directory: Path, file_name: str) -> Path:
    """`directory/file_name`, with `-1`, `-2`, ... inserted before the extension if it exists."""
    path = directory / file_name
    stem, suffix = path.stem, path.suffix
    counter = 1
    while path.exists():
        path = directory / f"{stem}-{counter}{suffix}"
        counter += 1
    return path


def save_image(image: Image.Image, path: Path, metadata: dict[str, Any], output_format: str = "png") -> Path:
    """Write `image`; PNGs carry `metadata` as JSON in a `parameters` text chunk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if output_format == "png":
        info = PngImagePlugin.PngInfo()
        info.add_text("parameters", json.dumps(metadata, sort_keys=True, default=str))
        image.save(path, format="PNG", pnginfo=info)
    else:
        image.save(path, format=output_format.upper())
    return path
