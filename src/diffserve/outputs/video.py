"""Generated videos: H.264 MP4 through PyAV, animated GIF/WebP through Pillow, PNG frame dumps.

Frames arrive as a uint8 RGB array of shape (frames, height, width, 3) and are encoded on the CPU, so
writing a video never touches an accelerator. Every format is written atomically (`write_atomically`)
and embeds `metadata_json` of the generation parameters (`video_metadata`) where it has room: the MP4 `comment` tag, a GIF
comment extension, the WebP EXIF ImageDescription.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
from PIL import Image

from diffserve.outputs.files import metadata_json, write_atomically
from diffserve.outputs.images import save_image

if TYPE_CHECKING:
    import av

logger = logging.getLogger(__name__)

VIDEO_FORMATS: tuple[str, ...] = ("mp4", "gif", "webp")
VideoOutputFormat = Literal["mp4", "gif", "webp"]

#: x264 CRF (0 lossless .. 51 worst) and preset, and Pillow's WebP quality (0 .. 100), when none is asked for.
MP4_DEFAULT_CRF = 20
MP4_PRESET = "medium"
WEBP_DEFAULT_QUALITY = 90

_EXIF_IMAGE_DESCRIPTION = 0x010E  # an ASCII tag: `metadata_json` escapes non-ASCII


def save_video(
    frames: np.ndarray,
    path: Path,
    fps: int,
    metadata: dict[str, Any],
    output_format: VideoOutputFormat = "mp4",
    quality: int | None = None,
) -> Path:
    """Write `frames` to `path` atomically; returns `path`.

    Arguments are validated before any file is created, so a bad request leaves nothing behind. `quality`
    is the x264 CRF for MP4, Pillow's 0..100 quality for WebP, and ignored for GIF.
    """
    _check_frames(frames)
    if output_format not in VIDEO_FORMATS:
        raise ValueError(f"unknown video format {output_format!r}; expected one of {VIDEO_FORMATS}")
    if isinstance(fps, bool) or not isinstance(fps, (int, np.integer)) or fps <= 0:
        raise ValueError(f"fps must be a positive integer, got {fps!r}")
    fps = int(fps)
    _check_quality(output_format, quality)
    if quality is None:
        quality = MP4_DEFAULT_CRF if output_format == "mp4" else WEBP_DEFAULT_QUALITY
    comment = metadata_json(video_metadata(metadata, output_format))

    def write(partial: Path) -> None:
        if output_format == "mp4":
            _write_mp4(frames, partial, fps, comment, quality)
        elif output_format == "gif":  # a 256-colour palette per frame
            _write_animation(frames, partial, fps, unit_ms=10, format="GIF", comment=comment)
        else:
            exif = Image.Exif()
            exif[_EXIF_IMAGE_DESCRIPTION] = comment
            _write_animation(
                frames, partial, fps, unit_ms=1, format="WEBP", quality=quality, exif=exif.tobytes()
            )

    return write_atomically(path, write)


def video_metadata(metadata: dict[str, Any], video_format: VideoOutputFormat) -> dict[str, Any]:
    """The record a video embeds: `metadata` without `output_format`, with `video_format` the container
    written. `output_format` is the format of images (a video request's params carry its default, "png"),
    so a video claiming it would tell a reader the wrong format."""
    record = {key: value for key, value in metadata.items() if key != "output_format"}
    record["video_format"] = video_format
    return record


def save_frames(frames: np.ndarray, directory: Path, stem: str) -> list[Path]:
    """Write every frame as a lossless PNG `{stem}_00000.png`, ... in `directory` (`--save-frames`), for
    tools (upscalers, interpolators, editors) that the video's compression would get in the way of."""
    _check_frames(frames)
    return [
        save_image(Image.fromarray(frame), directory / f"{stem}_{index:05d}.png", output_format="png")
        for index, frame in enumerate(frames)
    ]


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray):
        raise TypeError(f"frames must be a numpy array, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (frames, height, width, 3), got {frames.shape}")
    if 0 in frames.shape:
        raise ValueError(f"frames must be non-empty, got shape {frames.shape}")


def _check_quality(output_format: str, quality: int | None) -> None:
    if quality is None or output_format == "gif":
        return
    low, high = (0, 51) if output_format == "mp4" else (0, 100)
    if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) or not low <= quality <= high:
        raise ValueError(
            f"quality for {output_format} must be an integer in [{low}, {high}], got {quality!r}"
        )


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    """H.264 yuv420p needs even sizes: an odd height/width gets its last row/column repeated (and a
    warning), rather than a crop or a refusal."""
    _, height, width, _ = frames.shape
    pad_h, pad_w = height % 2, width % 2
    if not (pad_h or pad_w):
        return frames
    logger.warning(
        f"video size {width}x{height} is odd; H.264 yuv420p needs even sizes, so the MP4 is padded to "
        f"{width + pad_w}x{height + pad_h} by repeating the last column/row"
    )
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def _yuv_frames(frames: np.ndarray) -> Iterator[av.VideoFrame]:
    """RGB arrays -> BT.709 limited-range yuv420p frames with pts = frame index. The conversion is spelled
    out (the encoder's default matrix is BT.601) so that it matches what the stream is tagged with."""
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


class ExtraTrack(Protocol):
    """A further stream `_write_mp4` muxes next to the video (the audio of `outputs/audio_track.py`)."""

    def add_stream(self, container: av.container.OutputContainer) -> None:
        """Add the stream; called before anything is muxed (the header lists every stream)."""

    def mux(self, container: av.container.OutputContainer) -> None:
        """Encode and mux the whole track, encoder flush included; called after the video's packets."""


def _write_mp4(
    frames: np.ndarray, path: Path, fps: int, comment: str, crf: int, extra_track: ExtraTrack | None = None
) -> None:
    """H.264 at exactly `fps` (time base 1/fps, pts = frame index), tagged BT.709 limited range, with the
    index at the front (`faststart`) so browsers start playing before the download ends."""
    import av  # lazily: image-only deployments need not load it

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
        stream.codec_context.options = {
            "crf": str(crf),
            "preset": MP4_PRESET,
            "colorspace": "bt709",
            "color_primaries": "bt709",
            "color_trc": "bt709",
            "color_range": "tv",
        }
        if extra_track is not None:
            extra_track.add_stream(container)
        for frame in _yuv_frames(frames):
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the frames x264 holds back for lookahead/B-frames
        if extra_track is not None:
            extra_track.mux(container)


def _frame_durations(num_frames: int, fps: int, unit_ms: int) -> list[int]:
    """Per-frame delays in multiples of `unit_ms` whose running sum tracks `i * 1000 / fps` ms.

    GIF (10 ms units) and WebP (1 ms) cannot store 1000 / fps exactly for most rates; the rounding error is
    spread over the frames so the average rate is exact rather than drifting.
    """
    ticks_per_second = 1000 // unit_ms
    ends = [round((i + 1) * ticks_per_second / fps) for i in range(num_frames)]
    starts = [0, *ends[:-1]]
    return [max(end - start, 1) * unit_ms for start, end in zip(starts, ends, strict=True)]


def _write_animation(frames: np.ndarray, path: Path, fps: int, unit_ms: int, **options: Any) -> None:
    """A looping animated GIF or WebP through Pillow, which may merge identical consecutive frames (adding
    their delays); `options` are the format's own."""
    images = [Image.fromarray(frame) for frame in frames]
    durations = _frame_durations(len(images), fps, unit_ms)
    images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0, **options)
