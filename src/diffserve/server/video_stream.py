"""Chunk streaming of `/v1/videos` jobs created with `stream: true`: each chunk of frames the VAE decodes
becomes a fragmented-MP4 media segment (outputs/fmp4.py) that the engine writes to the job's file and
sends here (`JobChunk`) at once; subscribers (`GET /v1/videos/{id}/stream`, `/v1/realtime/videos`) get
the init segment, every chunk so far and then each new one, and last the job object.

Memory: a job's `ChunkStream` holds its segments (the bytes of its MP4, nothing more) while the job is in
flight; once it finishes the manager drops it, and a later subscriber reads the segments from the file
(`segment_table`), which is exactly the init segment and the segments in order. Each subscriber keeps
only its position in the list: a slow one is held back by its own connection (the server's writes wait
for it), a gone one is dropped, and neither holds up the job nor makes anything grow.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffserve.outputs.fmp4 import mime_type_of, segment_table
from diffserve.server.protocol import JobChunk

#: Seconds a subscriber waits for the next chunk before it is told the job is still running (an SSE
#: comment, so that proxies keep the connection and a gone client is noticed).
KEEPALIVE_S = 15.0


@dataclass(frozen=True)
class StreamedChunk:
    index: int
    start_frame: int
    num_frames: int
    fps: int
    data: bytes
    published_at: float = 0.0  # when the server had it (unix seconds); 0 when read back from the file

    def meta(self) -> dict[str, Any]:
        """What a subscriber is told of the chunk besides its bytes: its index, frames and time range."""
        fps = max(self.fps, 1)
        return {
            "index": self.index,
            "start_frame": self.start_frame,
            "num_frames": self.num_frames,
            "start_time": round(self.start_frame / fps, 6),
            "end_time": round((self.start_frame + self.num_frames) / fps, 6),
            "size_bytes": len(self.data),
            "published_at": self.published_at or None,
        }


class ChunkStream:
    """The segments of one streamed job in flight, in order, for its subscribers."""

    def __init__(self) -> None:
        self.init: bytes | None = None
        self.mime_type: str | None = None
        self.chunks: list[StreamedChunk] = []
        self.finished = False
        self._wake = asyncio.Event()

    def add(self, message: JobChunk) -> None:
        """A chunk from the engine. Only the next index is taken: a job run again after its engine died
        (replicas.py) sends its first chunks again, and subscribers have them already."""
        if self.finished or message.index != len(self.chunks):
            return
        if message.index == 0:
            self.init, self.mime_type = message.init, message.mime_type
        chunk = StreamedChunk(
            message.index, message.start_frame, message.num_frames, message.fps, message.data, time.time()
        )
        self.chunks.append(chunk)
        self._notify()

    def finish(self) -> None:
        self.finished = True
        self._notify()

    def chunk_frames(self) -> list[list[int]]:
        """(first frame, frame count) of each chunk: what the job records for subscribers after it ended."""
        return [[chunk.start_frame, chunk.num_frames] for chunk in self.chunks]

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def wait(self, seen: int, timeout: float) -> bool:
        """Wait until there are more than `seen` chunks or the job ended; False when `timeout` passed."""
        wake = self._wake
        if self.finished or len(self.chunks) > seen:
            return True
        try:
            await asyncio.wait_for(wake.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


def file_stream(path: Path, chunk_frames: list[list[int]], fps: int) -> ChunkStream:
    """A finished job's segments, read back from its file (`FragmentedMp4Writer`'s layout)."""
    data = path.read_bytes()
    table = segment_table(data)
    if len(table) != len(chunk_frames) + 1:
        raise ValueError(f"{path.name} holds {len(table) - 1} segments, the job recorded {len(chunk_frames)}")
    stream = ChunkStream()
    offset, size = table[0]
    stream.init = data[offset : offset + size]
    stream.mime_type = mime_type_of(stream.init)
    for index, ((offset, size), (start, count)) in enumerate(zip(table[1:], chunk_frames, strict=True)):
        stream.chunks.append(StreamedChunk(index, start, count, fps, data[offset : offset + size]))
    stream.finished = True
    return stream


#: One thing a subscriber is sent: ("init", mime type, init segment), ("chunk", StreamedChunk, None), or
#: ("keepalive", None, None) while it waits.
Event = tuple[str, Any, bytes | None]


async def subscribe(stream: ChunkStream) -> AsyncIterator[Event]:
    """The init segment once there is one, then every chunk in order (those so far first); ends once the
    job has ended and every chunk was given."""
    seen, init_sent = 0, False
    while True:
        if not init_sent and stream.init is not None:
            init_sent = True
            yield "init", stream.mime_type, stream.init
        while seen < len(stream.chunks):
            yield "chunk", stream.chunks[seen], None
            seen += 1
        if stream.finished:
            return
        if not await stream.wait(seen, KEEPALIVE_S):
            yield "keepalive", None, None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
