"""Streamed image responses: OpenAI's server-sent events for `"stream": true` on the image routes.

The job is accepted before the stream starts, so a bad parameter, a full queue or an engine that is not
ready is still a plain JSON error. Then: `image_generation.partial_image` events (the engine's previews)
and one `image_generation.completed` per image (`image_edit.*` for edits), as the `openai` SDK parses
them; a later error is an `error` event, and a client that goes away cancels the job.

`ContentFileResponse` serves the stored files (`/v1/images/{id}/content`, `/v1/videos/{id}/content`) with
HTTP Range support, a bad or unsatisfiable Range answered with OpenAI's JSON error.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.datastructures import Headers
from starlette.responses import (
    FileResponse,
    JSONResponse,
    MalformedRangeHeader,
    RangeNotSatisfiable,
    StreamingResponse,
)
from starlette.types import Message, Receive, Scope, Send

from diffserve.outputs import encoded_format
from diffserve.server.engine_client import EngineUnavailableError
from diffserve.server.errors import as_api_error, error_body, error_response
from diffserve.server.protocol import JobFinished, JobPreview

logger = logging.getLogger("diffserve.server")

#: A comment line is sent after this many seconds without an event, so proxies keep the connection open.
KEEPALIVE_S = 15.0

StreamKind = Literal["image_generation", "image_edit"]

#: Every usage counter of OpenAI's completed event, zero: diffserve has no image tokens to bill.
ZERO_USAGE: dict[str, Any] = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: its name and its JSON data (a single line, so no escaping is needed)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@dataclass(frozen=True)
class StreamHeader:
    """What every event of one stream repeats: the resolved size and the request's settings."""

    kind: StreamKind
    size: str  # "WIDTHxHEIGHT", as resolved by the engine
    output_format: str  # the final images' format
    quality: str = "auto"
    background: str = "auto"

    def event(self, name: str, data: bytes, output_format: str, image_index: int, **extra: Any) -> bytes:
        body = {
            "type": f"{self.kind}.{name}",
            "b64_json": base64.b64encode(data).decode("ascii"),
            "created_at": int(time.time()),
            "size": self.size,
            "quality": self.quality,
            "background": self.background,
            "output_format": output_format,
            "image_index": image_index,
            **extra,
        }
        return sse_event(body["type"], body)

    def partial(self, preview: JobPreview, image_index: int) -> bytes:
        data, index = preview.images[image_index], preview.index
        return self.event("partial_image", data, encoded_format(data), image_index, partial_image_index=index)

    def completed(
        self, data: bytes, image_index: int, seed: int, steps_computed_in_full: int | None = None
    ) -> bytes:
        # diffserve extensions: the seed used (as in the plain response) and steps_computed_in_full
        return self.event(
            "completed", data, self.output_format, image_index,
            usage=ZERO_USAGE, seed=seed, steps_computed_in_full=steps_computed_in_full,
        )  # fmt: skip


def error_event(exc: BaseException) -> bytes:
    """The statuses the same error gets from a plain request, carried in the event (the HTTP status is
    already 200)."""
    e = as_api_error(exc)
    return sse_event("error", {"type": "error", **error_body(e.status, e.message, e.param, e.code)})


def _events_of(header: StreamHeader, message: Any) -> list[bytes]:
    if isinstance(message, JobPreview):
        return [header.partial(message, i) for i in range(len(message.images))]
    return []  # JobStarted, JobProgress: OpenAI's stream has no event for them


async def image_events(
    header: StreamHeader,
    messages: asyncio.Queue,
    outcome: asyncio.Future,
    on_finished: Callable[[JobFinished], None],
    on_failed: Callable[[BaseException], None],
) -> AsyncIterator[bytes]:
    """The events of one accepted job, from its listener's `messages` and its outcome future;
    `on_finished(result)` or `on_failed(error)` is called (the metrics) before the last events."""
    # A stream the client left never awaits its outcome: retrieve the exception, so asyncio does not log it.
    outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
    while not outcome.done():
        get = asyncio.ensure_future(messages.get())
        try:
            done, _ = await asyncio.wait(
                {get, outcome}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not get.done():
                get.cancel()  # a queue's get() loses nothing when cancelled
        if get in done:
            for event in _events_of(header, get.result()):
                yield event
        elif not done:
            yield b": keep-alive\n\n"
    # The engine's messages are dispatched in order: previews sent before the job finished are queued.
    while not messages.empty():
        for event in _events_of(header, messages.get_nowait()):
            yield event
    if outcome.cancelled():  # not done by the engine client once a job is accepted; kept safe
        error: BaseException | None = EngineUnavailableError("the request was cancelled", code="cancelled")
    else:
        error = outcome.exception()
    if error is not None:
        on_failed(error)
        logger.warning("Streamed request failed after its stream started: %s", error)
        yield error_event(error)
        return
    result: JobFinished = outcome.result()
    on_finished(result)
    for index, image in enumerate(result.images):
        yield header.completed(image.data or b"", index, result.params.seed, result.steps_computed_in_full)


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` from an async iterator of encoded events, ended as soon as the client goes away
    (Starlette's own notices it only on a write with recent ASGI servers). `on_abandon` is called if the
    stream ends before its iterator: the client left, or making an event failed (logged; an `error` event)."""

    def __init__(self, events: AsyncIterator[bytes], on_abandon: Callable[[], None]) -> None:
        # no-cache and X-Accel-Buffering: proxies must pass each event on at once.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.events, self.on_abandon = events, on_abandon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        def body(data: bytes, more: bool = True) -> Message:
            return {"type": "http.response.body", "body": data, "more_body": more}

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        iterator = aiter(self.events)
        step: asyncio.Future | None = None
        complete = False
        try:
            while True:
                step = asyncio.ensure_future(anext(iterator))
                await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the client went away while the engine was working
                    break
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    complete = True
                    await send(body(b"", more=False))
                    break
                except Exception as exc:
                    logger.exception("Could not make the next event of a streamed response")
                    with contextlib.suppress(OSError):
                        await send(body(error_event(exc), more=False))
                    break
                try:
                    await send(body(chunk))
                except OSError:  # the client went away as we wrote
                    break
        finally:
            watcher.cancel()
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                    await step
            with contextlib.suppress(Exception):
                await iterator.aclose()
        if not complete:
            self.on_abandon()


class ContentFileResponse(FileResponse):
    """A FileResponse whose Range errors are OpenAI's JSON (400 `invalid_range`, 416
    `range_not_satisfiable` with `Content-Range: bytes */SIZE`), not Starlette's text/plain."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self._range_error(Headers(scope=scope))
        await (error or super().__call__)(scope, receive, send)

    def _range_error(self, headers: Headers) -> JSONResponse | None:
        """The answer when Starlette would refuse the Range header, else None (the routes are GET only)."""
        http_range, if_range = headers.get("range"), headers.get("if-range")
        if http_range is None:
            return None
        try:
            stat_result = os.stat(self.path)
        except OSError:
            return None  # Starlette reports the missing file
        self.set_stat_headers(stat_result)  # for If-Range's ETag / Last-Modified comparison
        if if_range is not None and not self._should_use_range(if_range):
            return None
        size = stat_result.st_size
        try:
            self._parse_range_header(http_range, size)
        except MalformedRangeHeader as exc:
            message = f"invalid Range header {http_range!r}: {exc.content}"
            return error_response(400, message, "range", "invalid_range")
        except RangeNotSatisfiable:
            message = f"Range {http_range!r} is not satisfiable: the file has {size} bytes"
            headers = {"Content-Range": f"bytes */{size}"}
            return error_response(416, message, "range", "range_not_satisfiable", headers)
        return None
