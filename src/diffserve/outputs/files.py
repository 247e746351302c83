"""What every output file shares: atomic writes, never-overwriting names, and the embedded parameters.

A file is written to a hidden `.{name}.partial` sibling and renamed onto its final name only once
complete, so a watcher of the output directory (or an HTTP client fetching a url) never sees a truncated
file, and a failed write leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffserve.configs.sampling_params import IMAGE_FIELDS

if TYPE_CHECKING:
    from diffserve.configs.sampling_params import SamplingParams


def partial_path(path: Path) -> Path:
    """The hidden sibling `path` is written to before it is complete (cleanup code deletes it too)."""
    return path.with_name(f".{path.name}.partial")


def write_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(partial)` to produce the file, then move it onto `path` (creating the directory).

    Any failure, an interrupt or a failed rename included, deletes the partial file (leaving an existing
    file at `path` as it was) and re-raises. Returns `path`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def prompt_slug(prompt: str) -> str:
    """A file-name-safe slug of the prompt ("A red fox!" -> "A_red_fox"), at most 60 characters."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")
    return slug[:60].rstrip("_") or "image"


def output_file_name(prompt: str, request_id: str, index: int, extension: str) -> str:
    """`{prompt slug}_{YYYYmmdd-HHMMSS}_{hash8}.{ext}`; the hash covers request id and output index, so the
    outputs of one request, and requests started in the same second, get different names."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    digest = hashlib.sha256(f"{request_id}:{index}:{prompt}".encode()).hexdigest()[:8]
    return f"{prompt_slug(prompt)}_{stamp}_{digest}.{extension}"


def unique_path(directory: Path, file_name: str) -> Path:
    """`directory/file_name`, with `-1`, `-2`, ... before the extension while that exists."""
    path = directory / file_name
    counter = 1
    while path.exists():
        path = directory / f"{Path(file_name).stem}-{counter}{path.suffix}"
        counter += 1
    return path


def output_metadata(model_path: str, diffusers_pipeline: str, params: SamplingParams) -> dict[str, Any]:
    """`{"model": ..., "pipeline": ..., **params}`, the record every file carries however it was made.

    Input images and the mask (`IMAGE_FIELDS`) are left out, even their sizes: they are inputs, not
    parameters, and a file's metadata must not depend on how the caller passed them.
    """
    fields = {k: v for k, v in params.to_dict().items() if k not in IMAGE_FIELDS}
    return {"model": model_path, "pipeline": diffusers_pipeline, **fields}


def metadata_json(metadata: dict[str, Any]) -> str:
    """The embedded text: JSON with sorted keys (equal metadata, equal bytes), other values as their `str`,
    non-ASCII escaped (so it fits ASCII-only slots such as EXIF tags)."""
    return json.dumps(metadata, sort_keys=True, default=str)
