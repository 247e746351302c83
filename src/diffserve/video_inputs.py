"""Input videos (SkyReels-V2 diffusion forcing's video extension): a file, uploaded bytes or a base64 data URL
decoded into its frames, RGB PIL images in order, within bounds a client cannot exceed.

MP4, MOV and Matroska/WebM are demuxed and decoded by PyAV (FFmpeg); animated GIF and WebP by Pillow. Any
other container (an image, a text file, an audio-only file) is refused before a frame is decoded. The
bounds are checked while decoding, so an over-long or over-large clip never sits in memory whole: the
encoded bytes (`max_bytes`), each frame's pixels (from the stream's header, before decoding), the frame
count (`max_frames`, stopped at the first frame over it) and the pixels of all frames together.

Every front end reads input videos here: `diffserve generate --video PATH` and `POST /v1/videos`'s `video`
(a multipart file, or a JSON data URL). `DiffGenerator.generate(video=...)` takes decoded frames.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageSequence, UnidentifiedImageError

from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import ImageTooLargeError

__all__ = [
    "MAX_INPUT_VIDEO_FRAMES",
    "MAX_INPUT_VIDEO_PIXELS",
    "VideoInputLimits",
    "decode_video",
    "load_video",
    "refuse_input_video",
]

_MIB = 1024 * 1024
#: Most frames an input video may have: far above what the extension encodes (its `overlap_history`, 17 or
#: 37 frames) while bounding what the output repeats (every input frame leads it).
MAX_INPUT_VIDEO_FRAMES = 1024
#: Most pixels of all frames together: 1024 frames of 1280x720 (2.7 GiB as RGB). A clip over it is refused
#: while decoding, before its frames exceed it.
MAX_INPUT_VIDEO_PIXELS = MAX_INPUT_VIDEO_FRAMES * 1280 * 720
#: FFmpeg's demuxer names (`container.format.name`) accepted; anything else is not a video here.
_AV_FORMATS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"})
#: Pillow's formats read as animations.
_PILLOW_FORMATS = frozenset({"GIF", "WEBP"})
_ACCEPTED = "an MP4, MOV, WebM, GIF or WebP video"


@dataclass(frozen=True)
class VideoInputLimits:
    """Bounds on an input video: its encoded size, its frame count, each frame's pixels and all frames'."""

    max_bytes: int = 512 * _MIB
    max_frames: int = MAX_INPUT_VIDEO_FRAMES
    max_frame_pixels: int = 4096 * 4096
    max_total_pixels: int = MAX_INPUT_VIDEO_PIXELS

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_frames", "max_frame_pixels", "max_total_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def refuse_input_video(pipeline: str) -> InvalidRequestError:
    """The refusal of an input video by a family that extends none (`pipeline` names it), param `video`:
    raised by its validation (`InputValidationStage.takes_input_video`), and by the server's POST
    /v1/videos before the upload is decoded."""
    return InvalidRequestError(
        f"video is not a parameter of {pipeline}: it extends no input video (only video-to-video families, "
        "which extend a video, take one: SkyReels-V2 diffusion forcing's video extension)",
        param="video",
    )


def load_video(source: str | Path | bytes, *, param: str, limits: VideoInputLimits) -> list[Image.Image]:
    """The frames of `source`: a file path (a `str` that is not a data URL is a path), raw bytes, or a
    base64 data URL (`data:video/mp4;base64,...`). InvalidRequestError naming `param` for what is not a
    readable video or over a bound (ImageTooLargeError, a 413 on the server, for the encoded size)."""
    if isinstance(source, bytes):
        data = source
    elif isinstance(source, str) and source.lstrip()[:5].lower() == "data:":
        data = _read_data_url(source.strip(), param=param, limits=limits)
    else:
        data = _read_path(Path(source), param=param, limits=limits)
    return decode_video(data, param=param, limits=limits)


def decode_video(data: bytes, *, param: str, limits: VideoInputLimits) -> list[Image.Image]:
    """`data`'s frames as RGB PIL images in order (see the module docstring for the formats and bounds)."""
    _check_bytes(len(data), param=param, limits=limits, what="the video")
    if not data:
        raise InvalidRequestError(f"{param}: the video is empty; send {_ACCEPTED}", param=param)
    animated = data[:4] == b"GIF8" or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")
    frames = _pillow_frames(data, param, limits) if animated else _av_frames(data, param, limits)
    kept: list[Image.Image] = []
    total = 0
    for frame in frames:
        if len(kept) == limits.max_frames:
            raise InvalidRequestError(
                f"{param}: the video has more than {limits.max_frames} frames, the most an input video may "
                f"have (limit: {limits.max_frames} frames); send a shorter clip (the extension continues from "
                "its last frames)",
                param=param,
            )
        _checked_size(frame.width, frame.height, param=param, limits=limits)  # a size that changes
        total += frame.width * frame.height
        if total > limits.max_total_pixels:
            raise InvalidRequestError(
                f"{param}: the video's frames hold more than {limits.max_total_pixels} pixels together (the "
                f"limit); send fewer or smaller frames",
                param=param,
            )
        kept.append(frame)
    if not kept:
        raise InvalidRequestError(f"{param}: the video has no frame; send {_ACCEPTED}", param=param)
    return kept


def _checked_size(width: int, height: int, *, param: str, limits: VideoInputLimits) -> None:
    if width <= 0 or height <= 0 or width * height > limits.max_frame_pixels:
        raise InvalidRequestError(
            f"{param}: the video's frames are {width}x{height}, over the limit of {limits.max_frame_pixels} "
            "pixels a frame",
            param=param,
        )


def _av_frames(data: bytes, param: str, limits: VideoInputLimits) -> Iterator[Image.Image]:
    """Frames of an MP4/MOV/WebM container (PyAV), decoded one at a time as they are asked for; the frame
    size the stream declares is checked before any is decoded."""
    import av

    not_video = f"{param}: not a readable video; send {_ACCEPTED}"
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise InvalidRequestError(f"{not_video} ({exc.__class__.__name__})", param=param) from None
    try:
        if container.format.name not in _AV_FORMATS:
            raise InvalidRequestError(
                f"{not_video} (its container is {container.format.name!r})", param=param
            )
        if not container.streams.video:
            raise InvalidRequestError(f"{param}: the file has no video track; send {_ACCEPTED}", param=param)
        stream = container.streams.video[0]
        context = stream.codec_context
        _checked_size(context.width, context.height, param=param, limits=limits)
        stream.thread_type = "AUTO"
        try:
            for frame in container.decode(stream):
                yield frame.to_image().convert("RGB")
        except av.error.FFmpegError as exc:
            raise InvalidRequestError(
                f"{param}: the video cannot be decoded ({exc.__class__.__name__}); send {_ACCEPTED}",
                param=param,
            ) from None
    finally:
        container.close()


def _pillow_frames(data: bytes, param: str, limits: VideoInputLimits) -> Iterator[Image.Image]:
    """Frames of an animated GIF or WebP (Pillow), each as displayed (disposal applied), as RGB; the canvas
    size is checked before any frame is decoded."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"{param}: not a readable video ({exc.__class__.__name__}); send {_ACCEPTED}", param=param
        ) from None
    with image:
        if image.format not in _PILLOW_FORMATS:
            raise InvalidRequestError(f"{param}: not a readable video; send {_ACCEPTED}", param=param)
        _checked_size(image.width, image.height, param=param, limits=limits)
        try:
            for frame in ImageSequence.Iterator(image):
                yield frame.convert("RGB")
        except (OSError, ValueError, EOFError) as exc:
            raise InvalidRequestError(
                f"{param}: the animation cannot be decoded ({exc.__class__.__name__}); send {_ACCEPTED}",
                param=param,
            ) from None


def _check_bytes(n: int, *, param: str, limits: VideoInputLimits, what: str) -> None:
    if n > limits.max_bytes:
        raise ImageTooLargeError(
            f"{param}: {what} is {n / _MIB:.1f} MiB, over the limit of {limits.max_bytes / _MIB:.1f} MiB",
            param=param,
        )


def _read_path(path: Path, *, param: str, limits: VideoInputLimits) -> bytes:
    shown = str(path) if len(str(path)) <= 200 else str(path)[:200] + "..."
    try:
        if not path.is_file():
            why = "is not a regular file" if path.exists() else "is not an existing file"
            raise InvalidRequestError(f"{param}: {shown!r} {why}; pass a video file", param=param)
        _check_bytes(path.stat().st_size, param=param, limits=limits, what=f"{shown!r}")
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(
            f"{param}: {shown!r} cannot be read ({exc.strerror or exc})", param=param
        ) from None
    _check_bytes(len(data), param=param, limits=limits, what=f"{shown!r}")
    return data


def _read_data_url(url: str, *, param: str, limits: VideoInputLimits) -> bytes:
    header, sep, payload = url.partition(",")
    meta = header[len("data:") :].split(";")
    media_type = meta[0].strip().lower()
    expected = "expected data:video/mp4;base64,<data> (or video/webm, image/gif, image/webp)"
    if not sep or "base64" not in (m.strip().lower() for m in meta[1:]):
        raise InvalidRequestError(f"{param}: malformed data URL; {expected}", param=param)
    if media_type and not media_type.startswith(("video/", "image/gif", "image/webp")):
        raise InvalidRequestError(
            f"{param}: data URL media type {media_type!r} is not a video; {expected}", param=param
        )
    payload = "".join(payload.split())
    _check_bytes(
        len(payload) // 4 * 3, param=param, limits=limits, what="the decoded data URL"
    )  # before decoding
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            f"{param}: the data URL's payload is not valid base64", param=param
        ) from None
