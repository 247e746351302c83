"""Reading the bodies of the routes that take images (`/v1/images/edits`, `/v1/videos`): multipart forms,
as OpenAI's SDK sends them, or JSON, validated into the route's pydantic model with 400s in the same
words as the other routes'."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from diffserve.server.errors import ApiError, validation_error
from diffserve.server.schemas import ApiParamError

_URL_SCHEMES = ("data:", "http://", "https://")
#: A raw image: uploaded bytes, or a data/http(s) URL string (decoded later, in a thread).
RawImage = bytes | str
M = TypeVar("M", bound=BaseModel)
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
