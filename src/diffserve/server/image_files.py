"""The files behind `response_format="url"`: one per image, `{output dir}/{image id}.{format}`, served by
`GET /v1/images/{image id}`. The bytes are written by `diffserve.outputs` (`save_image`)."""

from __future__ import annotations

import re
from pathlib import Path

from diffserve.outputs import CONTENT_TYPES

#: Image ids are `{request id (32 hex)}-{index}`; anything else is refused before touching the disk.
IMAGE_ID_PATTERN = re.compile(r"^[0-9a-f]{32}-[0-9]{1,2}$")


def image_path(output_dir: Path, image_id: str, output_format: str) -> Path:
    """Where the url file of `image_id` in `output_format` lives."""
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
