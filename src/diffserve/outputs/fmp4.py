"""Fragmented MP4 for streamed video jobs: an init segment (`ftyp` + `moov` without samples) and one media
segment (`moof` + `mdat`) per chunk of frames, written as the chunks come, so a client can play (Media
Source Extensions) or save the frames of a chunk as soon as it is decoded.

The file of the job is the init segment followed by every media segment, byte for byte: a client that
concatenates what it was streamed has the job's MP4. To hand each chunk's segment out at once (ffmpeg's
MP4 muxer only closes a fragment when the next one starts, or at its end), one H.264 encoder runs for
the whole clip and each chunk's packets go through a muxer of their own (`frag_custom+empty_moov+
default_base_moof+skip_trailer`: one fragment, written when it closes); its output after the init
segment is that chunk's fragment, whose sequence number and decode time (`tfdt`) are then set to follow
the previous chunk's. The encoder runs without lookahead or B-frames (x264's `zerolatency` tune), so
every frame's packet comes out as it goes in. Streamed jobs let x264 place the keyframes (a segment may
refer to frames of earlier ones: append them in order, as Media Source Extensions do); with
`keyframe_every_chunk` each chunk starts with an IDR frame and decodes after the init segment alone, at
about 1.6x the size. Frames are tagged and converted as `save_video`'s MP4 (BT.709 limited range), at
time base 1/fps with pts = frame index.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from diffserve.outputs.files import metadata_json, partial_path
from diffserve.outputs.video import (
    MP4_DEFAULT_CRF,
    MP4_PRESET,
    _check_frames,
    _pad_to_even,
    _yuv_frames,
    video_metadata,
)

#: The muxer flags of every chunk's muxer (see the module docstring).
FMP4_MOVFLAGS = "frag_custom+empty_moov+default_base_moof+skip_trailer"


def chunk_bounds(num_frames: int, temporal_factor: int) -> list[tuple[int, int]]:
    """(first frame, frame count) of each chunk a causal video VAE decodes: its first latent frame makes
    one frame, each next one `temporal_factor` frames (the last chunk may be shorter)."""
    bounds, start = [(0, min(1, num_frames))] if num_frames else [], 1
    while start < num_frames:
        count = min(max(temporal_factor, 1), num_frames - start)
        bounds.append((start, count))
        start += count
    return bounds


#: Called with each chunk as it is written: index, first frame, frame count, media segment, and for the
#: first chunk the init segment and its MediaSource type (None after).
ChunkSink = Callable[[int, int, int, bytes, bytes | None, str | None], None]


class StreamedMp4File:
    """A streamed job's fragmented MP4, written chunk by chunk to the hidden `.partial` sibling of `path`
    and moved onto `path` by `finish`; `on_chunk` is called with each chunk once it is in the file.

    `add(frames)` takes the chunks the decode hands out as it goes (engine process: on the encoder's
    thread, in order); `finish(frames)` is given the whole clip once decoded, checks that the frames added
    are its first ones, and writes the rest (`chunk_bounds`). One thread at a time."""

    def __init__(self, path: Path, fps: int, metadata: dict[str, Any], on_chunk: ChunkSink) -> None:
        self.path, self.partial = path, partial_path(path)
        self.on_chunk = on_chunk
        self.writer = FragmentedMp4Writer(
            fps, metadata_json(video_metadata(metadata, "mp4")), keyframe_every_chunk=False
        )
        self.frames_written = 0
        self._digests: list[tuple[int, int, str]] = []  # (first frame, count, sha256) of each chunk added
        self._file: Any = None
        self._chunks = 0
        self.error: Exception | None = None  # of `add_safely`
        #: Whether chunks are still handed out as decoded (the engine clears it when one cannot be).
        self.live = True

    def add(self, frames: np.ndarray) -> None:
        """Encode one chunk (the frames after those written), append it to the file, announce it."""
        _check_frames(frames)
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.partial.open("wb")
        segment = self.writer.add_chunk(frames)
        first = self._chunks == 0
        if first:
            self._file.write(self.writer.init_segment or b"")
        self._file.write(segment)
        self._file.flush()
        start, count = self.frames_written, len(frames)
        self._digests.append((start, count, hashlib.sha256(np.ascontiguousarray(frames)).hexdigest()))
        self.frames_written += count
        self._chunks += 1
        init = self.writer.init_segment if first else None
        self.on_chunk(self._chunks - 1, start, count, segment, init, self.writer.mime_type if first else None)

    def add_safely(self, frames: np.ndarray) -> None:
        """`add`, a failure kept for `finish` to raise (on an executor, where nobody waits for it)."""
        if self.error is not None:
            return
        try:
            self.add(frames)
        except Exception as exc:
            self.error = exc

    def matches(self, frames: np.ndarray) -> bool:
        """Whether the chunks added are the first frames of `frames` (the decode's whole clip)."""
        return all(
            hashlib.sha256(np.ascontiguousarray(frames[a : a + n])).hexdigest() == digest
            for a, n, digest in self._digests
        )

    def finish(
        self, frames: np.ndarray, temporal_factor: int, stop: Callable[[], bool] = lambda: False
    ) -> Path:
        """Write the frames of the clip not added yet, a chunk at a time (`stop()` asked before each: True
        aborts, InterruptedError), and move the file onto `path`. Any failure leaves nothing behind."""
        try:
            if self.error is not None:
                raise RuntimeError(f"streaming a chunk failed: {self.error}") from self.error
            _check_frames(frames)
            if len(frames) < self.frames_written:
                raise ValueError(f"{len(frames)} frames, fewer than the {self.frames_written} streamed")
            rest = chunk_bounds(len(frames), temporal_factor)
            if self.frames_written:  # after the streamed chunks: the next ones, temporal_factor frames each
                rest = [(a, n) for a, n in _groups(self.frames_written, len(frames), temporal_factor)]
            for start, count in rest:
                if stop():
                    raise InterruptedError("the streamed video was stopped")
                self.add(frames[start : start + count])
            self._close()
            os.replace(self.partial, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Stop: nothing is left on disk."""
        self._close()
        self.partial.unlink(missing_ok=True)

    def _close(self) -> None:
        self.writer.close()
        if self._file is not None:
            self._file.close()
            self._file = None


def _groups(start: int, end: int, size: int) -> list[tuple[int, int]]:
    size = max(size, 1)
    return [(a, min(size, end - a)) for a in range(start, end, size)]


def save_streamed_video(
    frames: np.ndarray,
    path: Path,
    fps: int,
    metadata: dict[str, Any],
    temporal_factor: int,
    on_chunk: ChunkSink,
    stop: Callable[[], bool] = lambda: False,
) -> Path:
    """Write `frames` to `path` atomically as a fragmented MP4, one media segment per VAE chunk
    (`chunk_bounds`), calling `on_chunk` with each as soon as it is in the file. `stop()` is asked before
    each chunk: True ends the write (InterruptedError; nothing is left at `path`)."""
    return StreamedMp4File(path, fps, metadata, on_chunk).finish(frames, temporal_factor, stop)


class FragmentedMp4Writer:
    """`add_chunk(frames)` -> that chunk's media segment; `init_segment` once the first chunk is added."""

    def __init__(
        self, fps: int, comment: str = "", crf: int = MP4_DEFAULT_CRF, keyframe_every_chunk: bool = True
    ) -> None:
        self.fps, self.comment, self.crf = int(fps), comment, crf
        #: Each chunk starts with an IDR frame, so that its segment decodes after the init segment alone
        #: (False: x264 places the keyframes, and a segment may need the ones before it; smaller files).
        self.keyframe_every_chunk = keyframe_every_chunk
        self.init_segment: bytes | None = None
        self._timescale = 0  # the track's (its `mdhd`)
        self.mime_type: str | None = None  # e.g. 'video/mp4; codecs="avc1.64001f"', for MediaSource
        self.frames_written = 0
        self._encoder: Any = None  # the encoding stream of `_holder`
        self._holder: Any = None
        self._size: tuple[int, int] | None = None
        self._fragments = 0

    def _open_encoder(self, width: int, height: int) -> None:
        """The encoder: a stream of a muxer that never gets a packet (it opens the encoder with the MP4
        muxer's global header, SPS/PPS out of band) and is the template of every chunk's muxer."""
        import av

        holder = av.open(io.BytesIO(), mode="w", format="mp4", container_options={"movflags": FMP4_MOVFLAGS})
        stream = holder.add_stream("libx264", rate=Fraction(self.fps, 1))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, self.fps)
        stream.codec_context.time_base = Fraction(1, self.fps)
        stream.codec_context.options = {
            "crf": str(self.crf),
            "preset": MP4_PRESET,
            "tune": "zerolatency",
            "forced-idr": "1",
            "colorspace": "bt709",
            "color_primaries": "bt709",
            "color_trc": "bt709",
            "color_range": "tv",
        }
        holder.start_encoding()
        self._holder, self._encoder, self._size = holder, stream, (width, height)

    def _mux(self, packets: list[Any]) -> bytes:
        """Everything one muxer writes for `packets`: the init segment, then their fragment."""
        import av

        buffer = io.BytesIO()
        options = {"movflags": FMP4_MOVFLAGS, "use_editlist": "0"}
        with av.open(buffer, mode="w", format="mp4", container_options=options) as container:
            container.metadata["comment"] = self.comment
            stream = container.add_stream_from_template(self._encoder)
            stream.time_base = Fraction(1, self.fps)
            container.start_encoding()
            for packet in packets:
                packet.stream = stream
                container.mux_one(packet)
        return buffer.getvalue()

    def add_chunk(self, frames: np.ndarray) -> bytes:
        import av

        """Encode `frames` (uint8 RGB, (n, h, w, 3), the size of the first chunk) and return their media
        segment; the first call also sets `init_segment`."""
        _check_frames(frames)
        frames = _pad_to_even(frames)
        _, height, width, _ = frames.shape
        if self._encoder is None:
            self._open_encoder(width, height)
        elif self._size != (width, height):
            raise ValueError(f"a chunk of size {width}x{height} in a {self._size[0]}x{self._size[1]} video")
        packets = []
        for i, frame in enumerate(_yuv_frames(frames)):
            frame.pts = self.frames_written + i
            if i == 0 and (self.keyframe_every_chunk or not self._fragments):
                frame.pict_type = av.video.frame.PictureType.I  # an IDR (x264's forced-idr)
            packets += self._encoder.encode(frame)
        if len(packets) != len(frames):
            raise RuntimeError(f"the encoder held back frames ({len(packets)} packets for {len(frames)})")
        for packet in packets:
            packet.time_base = Fraction(1, self.fps)
        data = self._mux(packets)
        init_size = _init_size(data)
        if self.init_segment is None:
            self.init_segment = data[:init_size]
            self.mime_type = mime_type_of(self.init_segment)
            self._timescale = _timescale(self.init_segment)
        start = self.frames_written * self._timescale // self.fps  # the timescale is a multiple of fps
        segment = _renumber(data[init_size:], self._fragments + 1, start)
        self._fragments += 1
        self.frames_written += len(frames)
        return segment

    def close(self) -> None:
        """Free the encoder (its muxer's output is thrown away)."""
        if self._holder is not None:
            self._holder.close()
            self._holder = self._encoder = None


def mime_type_of(init: bytes) -> str:
    """The MediaSource type of the stream an init segment starts (`MediaSource.isTypeSupported`)."""
    return f'video/mp4; codecs="{_avc1_codec(init)}"'


def _avc1_codec(init: bytes) -> str:
    """The RFC 6381 codec of the H.264 track: `avc1.` and the profile, constraints and level bytes of its
    `avcC` box (its bytes 1..3)."""
    at = init.find(b"avcC")
    if at < 0:
        raise RuntimeError("the init segment has no avcC box")
    return "avc1." + init[at + 5 : at + 8].hex()


def _boxes(data: bytes, start: int = 0, end: int | None = None) -> list[tuple[bytes, int, int]]:
    """The top-level boxes of `data[start:end]`: (type, offset, size)."""
    end = len(data) if end is None else end
    found, offset = [], start
    while offset + 8 <= end:
        size = int.from_bytes(data[offset : offset + 4], "big")
        kind = data[offset + 4 : offset + 8]
        if size == 1:
            size = int.from_bytes(data[offset + 8 : offset + 16], "big")
        if size < 8 or offset + size > end:
            raise ValueError(f"a malformed MP4 box {kind!r} at {offset}")
        found.append((kind, offset, size))
        offset += size
    return found


def _init_size(data: bytes) -> int:
    """Bytes of the init segment (`ftyp` + `moov`) at the head of a muxer's output."""
    for kind, offset, _ in _boxes(data):
        if kind == b"moof":
            return offset
    raise RuntimeError("the muxer wrote no fragment")


def _timescale(init: bytes) -> int:
    """The track's timescale: of the `mdhd` box (version 0: 32-bit times, version 1: 64-bit)."""
    at = init.find(b"mdhd")
    if at < 0:
        raise RuntimeError("the init segment has no mdhd box")
    field = at + 4 + (20 if init[at + 4] == 1 else 12)
    return int.from_bytes(init[field : field + 4], "big")


def _renumber(segment: bytes, sequence: int, decode_time: int) -> bytes:
    """Each chunk's muxer numbers its fragment 1 and starts its decode time at 0: set the `mfhd` sequence
    number and the `tfdt` base media decode time (in the track's timescale) of the clip."""
    out = bytearray(segment)
    for kind, offset, size in _boxes(segment):
        if kind != b"moof":
            continue
        for inner, at, inner_size in _boxes(segment, offset + 8, offset + size):
            if inner == b"mfhd":  # size, type, version+flags, sequence_number
                out[at + 12 : at + 16] = sequence.to_bytes(4, "big")
                sequence += 1
            if inner != b"traf":
                continue
            for box, where, _ in _boxes(segment, at + 8, at + inner_size):
                if box == b"tfdt":  # size, type, version+flags, baseMediaDecodeTime (32 or 64 bits)
                    width = 8 if segment[where + 8] == 1 else 4
                    own = int.from_bytes(
                        segment[where + 12 : where + 12 + width], "big"
                    )  # from the chunk's start
                    if (start := decode_time + own) >= 1 << (8 * width):
                        raise ValueError("the clip is too long for the fragment's 32-bit decode time")
                    out[where + 12 : where + 12 + width] = start.to_bytes(width, "big")
    return bytes(out)


def segment_table(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of the init segment, then of each media segment (`moof` and the boxes up to the next
    `moof`), in a fragmented MP4 as `FragmentedMp4Writer` writes it."""
    boxes = _boxes(data)
    starts = [offset for kind, offset, _ in boxes if kind == b"moof"]
    bounds = [0, *starts, len(data)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]
