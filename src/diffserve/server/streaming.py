"""Streamed image responses: OpenAI's server-sent events for `"stream": true` on the image routes.

A streamed request is validated and queued exactly like a plain one, *before* the stream starts: the
route submits the job with `EngineClient.submit`, which returns once the engine has accepted it, so
a bad parameter, a full queue or an engine that is not ready is a normal JSON error (400, 429, 503).
From then on the answer is `200 text/event-stream`, one event per message the engine sends back:

    event: image_generation.partial_image      (`partial_images` of them, per output image)
    data: {"type": "image_generation.partial_image", "b64_json": ..., "partial_image_index": 0, ...}

    event: image_generation.completed          (one per output image)
    data: {"type": "image_generation.completed", "b64_json": ..., "usage": {...}, ...}

`/v1/images/edits` sends the same with `image_edit.` names. The fields are those of the `openai` SDK's
`ImageGenPartialImageEvent` / `ImageGenCompletedEvent`; `usage` counts tokens of OpenAI's GPT image
models and is all zeros here. With `n` > 1 every preview step sends one partial event per output and
the request ends with one completed event per output, in order; `image_index` (a diffserve extension)
says which output an event belongs to. OpenAI has no progress event for images, so none is invented:
the engine's per-step JobProgress messages are not forwarded.

An error after the stream started (the engine failed on the request, or died, or the server shuts
down) ends the stream with `event: error` carrying OpenAI's error object under `error` (the SDK raises
it as `openai.APIError`). The client going away cancels the request in the engine at its next step
boundary, as for a plain request.

The previews are made in the engine (`diffserve.stages.previews`) and arrive encoded (PNG); each
event's `output_format` says what its bytes are.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from diffserve.outputs import encoded_format
from diffserve.server.engine_client import EngineUnavailableError, JobFailedError
from diffserve.server.errors import error_body
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


def error_fields(exc: BaseException) -> tuple[int, str, str | None, str | None]:
    """(status, message, param, code) of an error that ended a stream: the statuses the same error gets
    from a plain request (see errors.py), carried in the event since the HTTP status is already 200."""
    if isinstance(exc, JobFailedError):
        if exc.user_error:
            return 400, str(exc), None, "invalid_request"
        return 500, f"the engine failed on this request: {exc}", None, "engine_error"
    if isinstance(exc, EngineUnavailableError):
        return 503, str(exc), None, exc.code
    return 500, f"internal server error ({type(exc).__name__}); see the server log", None, "internal_error"


@dataclass(frozen=True)
class StreamHeader:
    """What every event of one stream repeats: the resolved size and the request's settings."""

    kind: StreamKind
    size: str  # "WIDTHxHEIGHT", as resolved by the engine
    output_format: str  # the final images' format
    quality: str = "auto"
    background: str = "auto"

    def common(self, name: str, b64_json: str, output_format: str, image_index: int) -> dict[str, Any]:
        return {
            "type": f"{self.kind}.{name}",
            "b64_json": b64_json,
            "created_at": int(time.time()),
            "size": self.size,
            "quality": self.quality,
            "background": self.background,
            "output_format": output_format,
            "image_index": image_index,
        }

    def partial(self, preview: JobPreview, image_index: int) -> bytes:
        data = preview.images[image_index]
        body = self.common(
            "partial_image", base64.b64encode(data).decode("ascii"), encoded_format(data), image_index
        )
        body["partial_image_index"] = preview.index
        return sse_event(body["type"], body)

    def completed(self, data: bytes, image_index: int, steps_computed_in_full: int | None = None) -> bytes:
        body = self.common(
            "completed", base64.b64encode(data).decode("ascii"), self.output_format, image_index
        )
        body["usage"] = ZERO_USAGE
        body["steps_computed_in_full"] = steps_computed_in_full  # diffserve extension (quality tiers)
        return sse_event(body["type"], body)


def error_event(exc: BaseException) -> bytes:
    status, message, param, code = error_fields(exc)
    return sse_event("error", {"type": "error", **error_body(status, message, param, code)})


class ImageEventStream:
    """The events of one accepted job, from the engine's messages (`messages`, filled by the job's
    listener) and its outcome future. `on_finished(result)` or `on_failed(error)` is called when the
    outcome is known (the route's metrics), before the last events are sent."""

    def __init__(
        self,
        header: StreamHeader,
        messages: asyncio.Queue,
        outcome: asyncio.Future,
        on_finished: Callable[[JobFinished], None],
        on_failed: Callable[[BaseException], None],
    ) -> None:
        self.header = header
        self.messages = messages
        self.outcome = outcome
        self.on_finished = on_finished
        self.on_failed = on_failed
        # Nobody awaits the outcome of a stream the client left; retrieve its exception so asyncio
        # does not log "Future exception was never retrieved".
        outcome.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _events_of(self, message: Any) -> list[bytes]:
        if isinstance(message, JobPreview):
            return [self.header.partial(message, i) for i in range(len(message.images))]
        return []  # JobStarted, JobProgress: OpenAI's stream has no event for them

    async def events(self) -> AsyncIterator[bytes]:
        while not self.outcome.done():
            get = asyncio.ensure_future(self.messages.get())
            try:
                done, _ = await asyncio.wait(
                    {get, self.outcome}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                if not get.done():
                    get.cancel()  # a queue's get() loses nothing when cancelled
            if get in done:
                for event in self._events_of(get.result()):
                    yield event
            elif not done:
                yield b": keep-alive\n\n"
        # The engine's messages are dispatched in order: previews sent before the job finished are queued.
        while not self.messages.empty():
            for event in self._events_of(self.messages.get_nowait()):
                yield event
        if self.outcome.cancelled():  # not done by the engine client once a job is accepted; kept safe
            error: BaseException | None = EngineUnavailableError(
                "the request was cancelled", code="cancelled"
            )
        else:
            error = self.outcome.exception()
        if error is not None:
            self.on_failed(error)
            logger.warning("Streamed request failed after its stream started: %s", error)
            yield error_event(error)
            return
        result: JobFinished = self.outcome.result()
        self.on_finished(result)
        for index, image in enumerate(result.images):
            yield self.header.completed(image.data or b"", index, result.steps_computed_in_full)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` from an async iterator of encoded events, ended early when the client goes
    away. That is noticed while waiting for the next event, not only when a write fails (Starlette's
    own StreamingResponse notices it only on a write with recent ASGI servers). `on_abandon` is called
    once if the stream ends before its iterator: the client went away, or making an event failed (a
    bug: logged, and the client gets an `error` event)."""

    def __init__(self, events: AsyncIterator[bytes], on_abandon: Callable[[], None]) -> None:
        # no-cache and X-Accel-Buffering: proxies must pass each event on at once.
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events
        self.on_abandon = on_abandon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        watcher = asyncio.ensure_future(_disconnected(receive))
        iterator = aiter(self.events)
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(iterator))
                await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the client went away while the engine was working
                    self.on_abandon()
                    return
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    logger.exception("Could not make the next event of a streamed response")
                    with contextlib.suppress(OSError):
                        await send(
                            {"type": "http.response.body", "body": error_event(exc), "more_body": False}
                        )
                    self.on_abandon()
                    return
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except OSError:  # the client went away as we wrote
                    self.on_abandon()
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                    await step
            with contextlib.suppress(Exception):
                await iterator.aclose()
