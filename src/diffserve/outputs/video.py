"""Generated videos: H.264 MP4 through PyAV, animated GIF/WebP through Pillow, PNG frame dumps.

A video reaches this module as a uint8 array of shape (frames, height, width, 3) in RGB order, after
denoising and VAE decoding. Everything here runs on the CPU in the engine process (libx264 and Pillow),
so writing a video never needs, and never touches, an accelerator.

Writes are atomic (`diffserve.outputs.atomic`): every format is encoded into a hidden sibling
`.{name}.partial` and moved onto the final path with `os.replace` only once the file is complete, and a
failure deletes the partial file. A watcher of the output directory therefore never sees a half-written
MP4 (whose index is written last and which players would reject) nor a truncated GIF/WebP. The embedded
generation parameters are `diffserve.outputs.metadata.metadata_json` of the metadata dict, as in PNGs.

Format notes:

- MP4: H.264 (libx264), yuv420p, BT.709 limited-range colour, tagged as such in the stream so players
  convert back with the same matrix. The frame rate is exactly `fps`: the stream's time base is
  `Fraction(1, fps)` and frame `i` has pts `i`, so the container's average rate reads back as `fps`.
  yuv420p halves the chroma resolution and H.264 needs even dimensions, so an odd width or height is
  PADDED by one pixel that repeats the last column/row (edge replicate; never cropped, never rejected)
  and a warning is logged with the old and new size. `quality` is the x264 CRF (0 = lossless .. 51 =
  worst; default 20, visually near-transparent for generated content); the preset is "medium". The
  generation parameters are stored as JSON in the container's `comment` tag (an MP4 `©cmt` atom), which
  `ffprobe -show_format` and `av.open(path).metadata["comment"]` read back. The `moov` index is moved to
  the front of the file (`faststart`) so browsers can start playing before the download ends.
- GIF: 256-colour palette per frame (Pillow's quantiser), loops forever. GIF delays are whole
  centiseconds, so per-frame delays are chosen so that their running sum tracks `i * 100 / fps`
  (e.g. 16 fps -> 60/60/70/60 ms): the average rate is exact even though single frames are not.
  Browsers clamp delays under 20 ms, so GIFs above 50 fps play slower. Pillow may merge identical
  consecutive frames (adding their delays), which keeps the timing but lowers the frame count.
  `quality` does not apply and is ignored. Metadata goes into a GIF comment extension (best effort:
  most tools ignore it; Pillow reads it back as `info["comment"]`).
- WebP: animated, lossy, loops forever, millisecond delays distributed like the GIF ones. `quality`
  is Pillow's WebP quality (0 .. 100, higher is better; default 90). Metadata goes into the EXIF
  ImageDescription tag (0x010E) as JSON (best effort; `Image.open(p).getexif()[0x010E]` reads it back).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image

from diffserve.outputs.atomic import write_atomically
from diffserve.outputs.images import save_image
from diffserve.outputs.metadata import metadata_json

logger = logging.getLogger(__name__)

VIDEO_FORMATS: tuple[str, ...] = ("mp4", "gif", "webp")
VideoOutputFormat = Literal["mp4", "gif", "webp"]

# x264 CRF 20 with preset "medium": visually near-lossless for smooth generated content at a modest size;
# slower presets buy a few percent of size for several times the encode time, not worth it per request.
MP4_DEFAULT_CRF = 20
MP4_PRESET = "medium"
WEBP_DEFAULT_QUALITY = 90

# EXIF ImageDescription: an ASCII tag; `metadata_json` escapes non-ASCII, so the JSON always fits.
_EXIF_IMAGE_DESCRIPTION = 0x010E


def save_video(
    frames: np.ndarray,
    path: Path,
    fps: int,
    metadata: dict[str, Any],
    output_format: VideoOutputFormat = "mp4",
    quality: int | None = None,
) -> Path:
    """Write `frames` (uint8 RGB, (frames, height, width, 3)) to `path` atomically; returns `path`.

    Arguments are validated before any file is created, so a bad request leaves nothing behind. `quality`
    is format-specific: the x264 CRF for MP4, Pillow's 0..100 quality for WebP, ignored for GIF (see the
    module docstring). The generation parameters in `metadata` are embedded where the format allows.
    """
    _check_frames(frames)
    if output_format not in VIDEO_FORMATS:
        raise ValueError(f"unknown video format {output_format!r}; expected one of {VIDEO_FORMATS}")
    if isinstance(fps, bool) or not isinstance(fps, (int, np.integer)) or fps <= 0:
        raise ValueError(f"fps must be a positive integer, got {fps!r}")
    fps = int(fps)
    _check_quality(output_format, quality)
    comment = metadata_json(metadata)

    def write(partial: Path) -> None:
        if output_format == "mp4":
            _write_mp4(frames, partial, fps, comment, MP4_DEFAULT_CRF if quality is None else quality)
        elif output_format == "gif":
            _write_gif(frames, partial, fps, comment)
        else:
            _write_webp(frames, partial, fps, comment, WEBP_DEFAULT_QUALITY if quality is None else quality)

    return write_atomically(path, write)


def save_frames(frames: np.ndarray, directory: Path, stem: str) -> list[Path]:
    """Write every frame as a lossless PNG `{stem}_00000.png`, ... in `directory` (for `--save-frames`).

    Individual frames are for inspection and post-processing (upscalers, interpolators, editors) where
    the compression of the video file would get in the way; five digits cover any clip length we make.
    """
    _check_frames(frames)
    return [
        save_image(Image.fromarray(frame), directory / f"{stem}_{index:05d}.png", output_format="png")
        for index, frame in enumerate(frames)
    ]


def _check_frames(frames: np.ndarray) -> None:
    """Reject anything but a non-empty uint8 (frames, height, width, 3) array, before any file exists."""
    if not isinstance(frames, np.ndarray):
        raise TypeError(f"frames must be a numpy array, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (frames, height, width, 3), got {frames.shape}")
    if 0 in frames.shape:
        raise ValueError(f"frames must be non-empty, got shape {frames.shape}")


def _check_quality(output_format: str, quality: int | None) -> None:
    """Range-check `quality` against the scale of `output_format` (CRF for MP4, 0..100 for WebP)."""
    if quality is None or output_format == "gif":
        return
    low, high = (0, 51) if output_format == "mp4" else (0, 100)
    if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) or not low <= quality <= high:
        raise ValueError(
            f"quality for {output_format} must be an integer in [{low}, {high}], got {quality!r}"
        )


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    """Repeat the last row/column where height/width is odd, because yuv420p needs even dimensions."""
    _, height, width, _ = frames.shape
    pad_h, pad_w = height % 2, width % 2
    if not (pad_h or pad_w):
        return frames
    logger.warning(
        "video size %dx%d is odd; H.264 yuv420p needs even sizes, so the MP4 is padded to %dx%d "
        "by repeating the last column/row",
        width,
        height,
        width + pad_w,
        height + pad_h,
    )
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def _yuv_frames(frames: np.ndarray) -> Iterator[Any]:
    """RGB arrays -> BT.709 limited-range yuv420p `av.VideoFrame`s with pts = frame index.

    The conversion is spelled out (rather than left to the encoder's default, which is BT.601) so that
    the matrix used here is the one the stream is tagged with, and players decode the right colours.
    """
    import av

    for index, rgb in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        frame = frame.reformat(
            format="yuv420p",
            src_colorspace="ITU709",
            dst_colorspace="ITU709",
            src_color_range="JPEG",
            dst_color_range="MPEG",
        )
        frame.pts = index
        yield frame


def _write_mp4(frames: np.ndarray, path: Path, fps: int, comment: str, crf: int) -> None:
    """Encode H.264 into an MP4 at `path` with an exact `fps` time base and `comment` metadata."""
    import av  # imported lazily: only video requests need it, and image-only deployments need not load it

    frames = _pad_to_even(frames)
    _, height, width, _ = frames.shape
    with av.open(
        str(path), mode="w", format="mp4", container_options={"movflags": "+faststart"}
    ) as container:
        container.metadata["comment"] = comment
        stream = container.add_stream("libx264", rate=Fraction(fps, 1))
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        stream.time_base = Fraction(1, fps)
        stream.codec_context.time_base = Fraction(1, fps)
        # Generic codec options (not x264-specific) that tag the stream and the `colr` atom with the
        # colour description `_yuv_frames` converts to.
        stream.codec_context.options = {
            "crf": str(crf),
            "preset": MP4_PRESET,
            "colorspace": "bt709",
            "color_primaries": "bt709",
            "color_trc": "bt709",
            "color_range": "tv",
        }
        for frame in _yuv_frames(frames):
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the frames x264 holds back for lookahead/B-frames


def _frame_durations(num_frames: int, fps: int, unit_ms: int) -> list[int]:
    """Per-frame delays in multiples of `unit_ms` whose running sum tracks `i * 1000 / fps` ms.

    GIF (10 ms units) and WebP (1 ms) cannot store 1000 / fps exactly for most rates; rounding every
    frame the same way would drift (16 fps as 60 ms each plays at 16.7 fps), so the error is spread.
    """
    ticks_per_second = 1000 // unit_ms
    ends = [round((i + 1) * ticks_per_second / fps) for i in range(num_frames)]
    starts = [0, *ends[:-1]]
    return [max(end - start, 1) * unit_ms for start, end in zip(starts, ends, strict=True)]


def _write_gif(frames: np.ndarray, path: Path, fps: int, comment: str) -> None:
    """Animated GIF, looping forever, metadata in a comment extension."""
    images = [Image.fromarray(frame) for frame in frames]
    images[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=images[1:],
        duration=_frame_durations(len(images), fps, unit_ms=10),
        loop=0,
        comment=comment,
    )


def _write_webp(frames: np.ndarray, path: Path, fps: int, comment: str, quality: int) -> None:
    """Animated lossy WebP, looping forever, metadata in EXIF ImageDescription."""
    images = [Image.fromarray(frame) for frame in frames]
    exif = Image.Exif()
    exif[_EXIF_IMAGE_DESCRIPTION] = comment
    images[0].save(
        path,
        format="WEBP",
        save_all=True,
        append_images=images[1:],
        duration=_frame_durations(len(images), fps, unit_ms=1),
        loop=0,
        quality=quality,
        exif=exif.tobytes(),
    )
