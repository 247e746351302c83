"""Reading the bodies of the routes that take images (`/v1/images/edits`, `/v1/videos`): multipart forms,
as OpenAI's SDK sends them, or JSON, validated into the route's pydantic model with 400s in the same
words as the other routes'; and loading their images off the event loop (`load_input_image`), in worker
pools of their own, so that neither the loop (and /health with it) nor the default executor's threads
(which the engine client's restarts use) wait on a decode or a slow download."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from PIL import Image
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import ImageInputLimits, decode_image, load_image, read_image_source
from diffserve.server.errors import ApiError, validation_error
from diffserve.server.schemas import ApiParamError

_URL_SCHEMES = ("data:", "http://", "https://")
#: A raw image: uploaded bytes, or a data/http(s) URL string (decoded later, in a thread).
RawImage = bytes | str
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
_TOO_DEEP = (
    "request body is nested too deeply to parse; send a JSON object of the route's fields (strings, "
    "numbers and at most an object or list of image references in each)"
)


async def read_body(
    request: Request, model: type[M], accepted: Sequence[str], files: Collection[str],
    text_only: Collection[str] | None, empty: str, send: str, **form_limits: int,
) -> tuple[M, list[tuple[str, RawImage]] | None]:  # fmt: skip
    """The body, by its Content-Type, as the route's model and its image parts (`split_form`; None for
    JSON). `empty`: the error for an empty JSON body; `send`: the accepted types, in the 415."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        async with request.form(**form_limits) as form:
            fields, found = await split_form(form.multi_items(), files, text_only)
        return validate(model, fields, accepted), found
    if kind not in ("application/json", ""):
        message = f"Content-Type {kind!r} is not supported; send {send}"
        raise ApiError(415, message, code="unsupported_media_type")
    raw = await request.body()
    if not raw:
        raise ApiError(400, empty, code="invalid_request")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc})", code="invalid_request") from None
    except RecursionError:
        raise ApiError(400, _TOO_DEEP, code="invalid_request") from None
    return validate(model, data, accepted), None


def validate(model: type[M], data: Any, accepted: Sequence[str]) -> M:
    """`data` as the route's model; `accepted` (its fields) are listed when a field is unknown."""
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_request")
    try:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            error = validation_error(list(exc.errors()), accepted)  # its message holds repr(the value)
    except RecursionError:
        raise ApiError(400, _TOO_DEEP, code="invalid_request") from None
    raise error from None


async def split_form(
    items: list[tuple[str, str | UploadFile]], file_parts: Collection[str], text_only: Collection[str] | None
) -> tuple[dict[str, Any], list[tuple[str, RawImage]]]:
    """A form's fields (each at most once) and its image parts (`file_parts`: uploads, or text holding a
    URL), in order. A file in a field of `text_only` (None: every field) is refused; a file under an
    unknown name is kept as a field, for validation to name it."""
    fields: dict[str, Any] = {}
    files: list[tuple[str, RawImage]] = []
    for name, value in items:
        upload = isinstance(value, UploadFile)
        if name in file_parts:
            files.append((name, await value.read() if upload else value))
        elif name in fields:
            raise ApiParamError(f"{name} is given more than once", param=name)
        elif upload and (text_only is None or name in text_only):
            raise ApiParamError(f"{name} must be a text field, not a file", param=name)
        else:
            fields[name] = await value.read() if upload else value
    return fields, files


def check_source(param: str, source: RawImage) -> None:
    """Refuse a string that is neither a data URL nor an http(s) one, before anything is decoded."""
    if isinstance(source, str) and not source.strip()[:16].lower().startswith(_URL_SCHEMES):
        raise ApiParamError(
            f"{param}: expected an uploaded file, a base64 data URL (data:image/png;base64,...) or an "
            "http(s) URL; the server never reads file paths",
            param=param,
        )


# ---------------------------------------------------------------------------------- loading off the loop


class WorkerPool:
    """Threads of its own for one kind of blocking work: at most `workers` jobs run and `max_waiting` more
    wait; a job beyond that is refused at once with a 429 (`busy` says why), so waiting work (and the
    request bodies it holds) cannot pile up without bound. A slot is freed when its job ends, not when
    its caller stops waiting (a client that hangs up does not free a thread still decoding)."""

    def __init__(self, name: str, workers: int, max_waiting: int, busy: str) -> None:
        self.name, self.busy = name, busy
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(workers + max_waiting)

    async def run(self, job: Callable[[], T]) -> T:
        """`job()`'s result, run on one of the pool's threads (429 when the pool is full)."""
        if not self._slots.acquire(blocking=False):
            raise ApiError(429, self.busy, code="queue_full", headers={"Retry-After": "1"})
        try:
            future: Future[T] = self._executor.submit(job)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(future)


_DECODE_WORKERS = min(4, os.cpu_count() or 1)
#: Base64 and pixel decoding of input images (CPU-bound; Pillow releases the GIL while decoding).
DECODE_POOL = WorkerPool(
    "image-decode", _DECODE_WORKERS, 8 * _DECODE_WORKERS,
    "the server is decoding as many input images as it queues; retry shortly",
)  # fmt: skip
#: Downloads of input images (`--allow-url-images`): I/O-bound, each within its own deadline.
FETCH_POOL = WorkerPool(
    "image-fetch", 8, 32, "the server is downloading as many input images as it queues; retry shortly"
)
#: How long past its own deadline a download may keep its caller waiting (name resolution, which the
#: download's deadline cannot interrupt); the thread itself keeps its pool slot until it returns.
FETCH_GRACE_S = 2.0


def _is_url(source: RawImage) -> bool:
    return isinstance(source, str) and source.strip()[:8].lower().startswith(("http://", "https://"))


async def load_input_image(
    source: RawImage,
    param: str,
    allow_urls: bool,
    limits: ImageInputLimits,
    keep_alpha: bool = False,
    as_mask: bool = False,
) -> Image.Image:
    """One input image as RGB (`keep_alpha`: RGBA when it has transparency; `as_mask`: an inpainting mask
    in the mode the pipelines read it in, `image_inputs.loaded_mode`), never on the
    event loop: a URL (with `allow_urls`) is downloaded in FETCH_POOL within `limits.url_timeout_s`, and
    everything is decoded in DECODE_POOL. Raises InvalidRequestError (ImageTooLargeError: 413) naming
    `param`, and ApiError 429 when a pool is full."""
    if allow_urls and _is_url(source):
        fetch = functools.partial(read_image_source, source, param=param, allow_urls=True, limits=limits)
        try:
            data = await asyncio.wait_for(FETCH_POOL.run(fetch), limits.url_timeout_s + FETCH_GRACE_S)
        except asyncio.TimeoutError:
            message = f"{param}: fetching the image URL timed out after {limits.url_timeout_s:g} s"
            raise InvalidRequestError(message, param=param) from None
        decode = functools.partial(
            decode_image, data, param=param, limits=limits, keep_alpha=keep_alpha, as_mask=as_mask
        )
        return await DECODE_POOL.run(decode)
    load = functools.partial(
        load_image,
        source,
        param=param,
        allow_urls=allow_urls,
        limits=limits,
        keep_alpha=keep_alpha,
        as_mask=as_mask,
    )
    return await DECODE_POOL.run(load)
