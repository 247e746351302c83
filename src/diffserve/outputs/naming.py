"""Names of output files: prompt slugs, timestamped collision-resistant names, never-overwriting paths."""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

_SLUG_MAX = 60


def prompt_slug(prompt: str) -> str:
    """A file-name-safe slug of the prompt ("A red fox!" -> "A_red_fox"), at most 60 characters."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")
    return slug[:_SLUG_MAX].rstrip("_") or "image"


def output_file_name(prompt: str, request_id: str, index: int, extension: str) -> str:
    """`{prompt slug}_{YYYYmmdd-HHMMSS}_{hash8}.{ext}`; the hash covers request id and output index, so the
    outputs of one request, and requests started in the same second, get different names."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    digest = hashlib.sha256(f"{request_id}:{index}:{prompt}".encode()).hexdigest()[:8]
    return f"{prompt_slug(prompt)}_{stamp}_{digest}.{extension}"


def unique_path(directory: Path, file_name: str) -> Path:
    """`directory/file_name`, with `-1`, `-2`, ... inserted before the extension if it exists, so an
    existing file is never overwritten."""
    path = directory / file_name
    stem, suffix = path.stem, path.suffix
    counter = 1
    while path.exists():
        path = directory / f"{stem}-{counter}{suffix}"
        counter += 1
    return path
