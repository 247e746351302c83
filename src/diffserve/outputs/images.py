"""Still images: the one PNG/JPEG/WebP encoder behind files (CLI, Python API, server urls) and HTTP bodies
(b64_json, streamed previews), so one image and quality give the same bytes everywhere."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Literal

from PIL import Image, PngImagePlugin

from diffserve.outputs.files import metadata_json, write_atomically

ImageOutputFormat = Literal["png", "jpeg", "webp"]
IMAGE_FORMATS: tuple[str, ...] = ("png", "jpeg", "webp")
CONTENT_TYPES: dict[str, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}

#: JPEG/WebP quality when none is asked for: OpenAI's `output_compression` default, so a file written by
#: `diffserve generate` and an image returned by the server are the same bytes.
DEFAULT_IMAGE_QUALITY = 100

#: Longest prompt (and negative prompt) a file's embedded parameters keep, in characters: a longer one is
#: cut to this length, ending with "…", and `prompt_chars` (`negative_prompt_chars`) gives its full length.
MAX_METADATA_TEXT_CHARS = 2000
_BOUNDED_TEXT_FIELDS = ("prompt", "negative_prompt")


def bounded_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """`metadata` with its prompts cut to `MAX_METADATA_TEXT_CHARS` (a copy; idempotent), so every file a
    request writes stays small whatever prompt it was sent with."""
    bounded = dict(metadata)
    for name in _BOUNDED_TEXT_FIELDS:
        text = bounded.get(name)
        if isinstance(text, str) and len(text) > MAX_METADATA_TEXT_CHARS:
            bounded[name] = text[: MAX_METADATA_TEXT_CHARS - 1] + "…"
            bounded[f"{name}_chars"] = len(text)
    return bounded


def encode_image(
    image: Image.Image,
    output_format: str,
    quality: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> bytes:
    """Encode one image as `output_format` ("png", "jpeg" or "webp").

    `quality` (0..100, None: `DEFAULT_IMAGE_QUALITY`) applies to JPEG and WebP; PNG is lossless. Only PNGs
    carry `metadata`, as JSON in a `parameters` text chunk (`Image.open(p).text["parameters"]`), its prompts
    bounded (`bounded_metadata`).
    """
    if output_format not in IMAGE_FORMATS:
        raise ValueError(f"unknown image format {output_format!r}; expected one of {IMAGE_FORMATS}")
    buffer = io.BytesIO()
    if output_format == "png":
        info = PngImagePlugin.PngInfo()
        if metadata is not None:
            info.add_text("parameters", metadata_json(bounded_metadata(metadata)))
        image.save(buffer, format="PNG", pnginfo=info)
    else:
        quality = DEFAULT_IMAGE_QUALITY if quality is None else quality
        if isinstance(quality, bool) or not isinstance(quality, int) or not 0 <= quality <= 100:
            raise ValueError(f"quality for {output_format} must be an integer in [0, 100], got {quality!r}")
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        rgb.save(buffer, format=output_format.upper(), quality=quality)
    return buffer.getvalue()


def save_image(
    image: Image.Image,
    path: Path,
    metadata: dict[str, Any] | None = None,
    output_format: str = "png",
    quality: int | None = None,
) -> Path:
    """Write `encode_image(image, output_format, quality, metadata)` to `path` atomically; returns `path`."""
    data = encode_image(image, output_format, quality, metadata)
    return write_atomically(path, lambda partial: partial.write_bytes(data))


def encoded_format(data: bytes) -> ImageOutputFormat:
    """The format of encoded image bytes, from their signature."""
    if data.startswith(b"\x89PNG"):
        return "png"
    if data.startswith(b"\xff\xd8"):
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    raise ValueError("image bytes of an unknown format (expected PNG, JPEG or WebP)")
