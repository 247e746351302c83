"""Output files and bytes, shared by the CLI, the Python API and the server.

- `images`: PNG/JPEG/WebP encoding (`encode_image`, one quality rule everywhere) and `save_image`.
- `video`: MP4 (H.264) / GIF / WebP clips (`save_video`) and per-frame PNGs (`save_frames`).
- `metadata`: the generation parameters embedded in every file (`output_metadata`).
- `naming`: output file names (`output_file_name`, `prompt_slug`) and never-overwriting paths.
- `atomic`: files appear under their final name only once complete.
- `write`: `write_outputs`, a finished request's images or videos written to a directory.
"""

from diffserve.outputs.atomic import partial_path, write_atomically, write_bytes_atomically
from diffserve.outputs.images import (
    CONTENT_TYPES,
    DEFAULT_IMAGE_QUALITY,
    IMAGE_FORMATS,
    ImageOutputFormat,
    encode_image,
    encoded_format,
    save_image,
)
from diffserve.outputs.metadata import metadata_json, output_metadata
from diffserve.outputs.naming import output_file_name, prompt_slug, unique_path
from diffserve.outputs.video import VIDEO_FORMATS, VideoOutputFormat, save_frames, save_video
from diffserve.outputs.write import write_outputs

__all__ = [
    "CONTENT_TYPES",
    "DEFAULT_IMAGE_QUALITY",
    "IMAGE_FORMATS",
    "VIDEO_FORMATS",
    "ImageOutputFormat",
    "VideoOutputFormat",
    "encode_image",
    "encoded_format",
    "metadata_json",
    "output_file_name",
    "output_metadata",
    "partial_path",
    "prompt_slug",
    "save_frames",
    "save_image",
    "save_video",
    "unique_path",
    "write_atomically",
    "write_bytes_atomically",
    "write_outputs",
]
