"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the right status.

`as_api_error` maps every error the server can meet to its answer, for plain responses and for the
`error` event of a stream alike: pydantic validation is a 400 (never FastAPI's 422), anything
unexpected a 500 (logged with its traceback; the server carries on).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import ImageTooLargeError
from diffserve.server.engine_client import (
    EngineUnavailableError,
    JobFailedError,
    JobRejectedError,
    QueueFullError,
)
from diffserve.server.lora_client import LoraOpError
from diffserve.server.schemas import ACCEPTED_FIELDS, ApiParamError, ErrorResponse

logger = logging.getLogger("diffserve.server")

#: status -> OpenAI error type.
ERROR_TYPES = {
    **dict.fromkeys((400, 405, 409, 413, 415, 416), "invalid_request_error"),
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's error `responses` for /docs."""
    return {status: {"model": ErrorResponse} for status in statuses}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:  # fmt: skip
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def as_api_error(exc: BaseException) -> ApiError:
    """The answer to `exc` (an unknown error is a 500 that points to the server log)."""
    if isinstance(exc, ApiError):
        return exc
    message = str(exc)
    if isinstance(exc, ApiParamError):
        return ApiError(400, message, param=exc.param, code=exc.code)
    if isinstance(exc, ImageTooLargeError):  # decoding input images (diffserve.image_inputs.load_image)
        return ApiError(413, message, param=exc.param, code="image_too_large")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, message, param=exc.param, code="invalid_value")
    if isinstance(exc, JobRejectedError):  # 413: the engine's memory admission, it can never fit
        code = "request_too_large" if exc.status == 413 else "invalid_value"
        return ApiError(exc.status, message, param=exc.param, code=code)
    if isinstance(exc, LoraOpError):  # the engine's answer to a LoRA admin op (503: retry, SDKs do)
        retry = {"Retry-After": "5"} if exc.status in (429, 503) else None
        return ApiError(exc.status, message, param=exc.param, code=exc.code, headers=retry)
    if isinstance(exc, QueueFullError):
        return ApiError(429, message, code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineUnavailableError):
        return ApiError(503, message, code=exc.code, headers={"Retry-After": "5"})
    if isinstance(exc, JobFailedError) and exc.user_error:
        return ApiError(
            400, message, param=exc.param, code="invalid_value" if exc.param else "invalid_request"
        )
    if isinstance(exc, JobFailedError):
        return ApiError(500, f"the engine failed on this request: {exc}", code="engine_error")
    if isinstance(exc, StarletteHTTPException):  # e.g. a malformed multipart body (400), a body over 413
        return _http_error(exc, str(exc.detail))
    name = type(exc).__name__
    return ApiError(500, f"internal server error ({name}); see the server log", code="internal_error")


def _http_error(exc: StarletteHTTPException, message: str) -> ApiError:
    headers = getattr(exc, "headers", None)
    return ApiError(exc.status_code, message, code=_HTTP_CODES.get(exc.status_code), headers=headers)


def validation_error_message(
    errors: list[dict[str, Any]], accepted: Sequence[str] = ACCEPTED_FIELDS
) -> tuple[str, str | None]:
    """One actionable sentence (and the offending field) from pydantic's error list. `accepted`: the
    route's fields, listed when a field is unknown."""
    unknown = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        names, s = ", ".join(repr(n) for n in unknown), "s" if len(unknown) > 1 else ""
        return f"unknown field{s} {names}; accepted fields: {', '.join(accepted)}", unknown[0]
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"request body is not valid JSON ({first.get('ctx', {}).get('error', '')})", None
    if kind == "missing" and not loc:
        return "request body is required: a JSON object with at least 'prompt'", None
    if kind in ("model_attributes_type", "dict_type") and not loc:
        return "request body must be a JSON object", None
    param = loc[0] if loc else None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")  # a validator's own words
    if kind == "missing":
        return f"{param} is required", param
    if "input" in first:
        return f"{param}: {message}, got {first['input']!r}", param
    return f"{param}: {message}", param


def validation_error(errors: list[dict[str, Any]], accepted: Sequence[str] = ACCEPTED_FIELDS) -> ApiError:
    message, param = validation_error_message(errors, accepted)
    return ApiError(400, message, param=param, code="invalid_value" if param else "invalid_request")


def _respond(error: ApiError) -> JSONResponse:
    return error_response(error.status, error.message, error.param, error.code, error.headers)


def install_error_handlers(app: FastAPI) -> None:
    async def known(request: Request, exc: Exception) -> JSONResponse:
        return _respond(as_api_error(exc))

    # Known errors are answered without a traceback in the log.
    known_errors = (
        ApiError,
        ApiParamError,
        InvalidRequestError,
        JobRejectedError,
        QueueFullError,
        LoraOpError,
    )
    for kind in (*known_errors, EngineUnavailableError, JobFailedError):
        app.add_exception_handler(kind, known)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _respond(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _respond(_http_error(exc, message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # %r: the client's method and path must not forge log lines.
        logger.error("Unhandled error on %r %r", request.method, request.url.path, exc_info=exc)
        return _respond(as_api_error(exc))
