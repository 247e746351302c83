"""Output files and bytes, shared by the CLI, the Python API and the server: `files` (atomic writes,
names, embedded parameters), `images` (PNG/JPEG/WebP), `video` (MP4/GIF/WebP clips, frame PNGs) and
`write` (`write_outputs`: a finished request's outputs written to a directory)."""

from diffserve.outputs.files import (
    metadata_json,
    output_file_name,
    output_metadata,
    partial_path,
    prompt_slug,
    unique_path,
    write_atomically,
)
from diffserve.outputs.images import (
    CONTENT_TYPES,
    DEFAULT_IMAGE_QUALITY,
    IMAGE_FORMATS,
    ImageOutputFormat,
    encode_image,
    encoded_format,
    save_image,
)
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
    "write_outputs",
]
