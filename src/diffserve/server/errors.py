"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the right status.

Every error the server answers goes through `error_response`: API errors raised by routes, pydantic
validation (400, never FastAPI's 422), unknown routes (404), the engine client's errors (400, 429,
500, 503) and anything unexpected (500, logged with its traceback; the server carries on).
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
from diffserve.server.schemas import ACCEPTED_FIELDS, ApiParamError

logger = logging.getLogger("diffserve.server")

#: status -> OpenAI error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def validation_error_message(
    errors: list[dict[str, Any]], accepted: Sequence[str] = ACCEPTED_FIELDS
) -> tuple[str, str | None]:
    """One actionable sentence (and the offending field) from pydantic's error list. `accepted`: the
    route's fields, listed when a field is unknown."""
    unknown = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        names = ", ".join(repr(n) for n in unknown)
        return (
            f"unknown field{'s' if len(unknown) > 1 else ''} {names}; accepted fields: {', '.join(accepted)}",
            unknown[0],
        )
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"request body is not valid JSON ({detail})", None
    if kind == "missing" and not loc:
        return "request body is required: a JSON object with at least 'prompt'", None
    if kind in ("model_attributes_type", "dict_type") and not loc:
        return "request body must be a JSON object", None
    param = loc[0] if loc else None
    message = first.get("msg", "invalid value")
    if kind == "missing":
        return f"{param} is required", param
    if "input" in first and kind != "missing":
        return f"{param}: {message}, got {first['input']!r}", param
    return f"{param}: {message}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(ApiParamError)
    async def _param_error(request: Request, exc: ApiParamError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, exc.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid_input(request: Request, exc: InvalidRequestError) -> JSONResponse:
        # Raised in the front end while decoding input images (diffserve.image_inputs.load_image).
        if isinstance(exc, ImageTooLargeError):
            return error_response(413, str(exc), exc.param, "image_too_large")
        return error_response(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error_message(list(exc.errors()))
        return error_response(400, message, param, "invalid_value" if param else "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = {
            404: "not_found",
            405: "method_not_allowed",
            413: "request_too_large",
            415: "unsupported_media_type",
        }.get(exc.status_code)
        return error_response(exc.status_code, message, None, code, getattr(exc, "headers", None))

    @app.exception_handler(JobRejectedError)
    async def _rejected(request: Request, exc: JobRejectedError) -> JSONResponse:
        if exc.status == 413:  # the engine's memory admission: it can never fit, even alone
            return error_response(413, str(exc), exc.param, "request_too_large")
        return error_response(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(429, str(exc), None, "queue_full", {"Retry-After": "1"})

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(request: Request, exc: EngineUnavailableError) -> JSONResponse:
        return error_response(503, str(exc), None, exc.code, {"Retry-After": "5"})

    @app.exception_handler(JobFailedError)
    async def _failed(request: Request, exc: JobFailedError) -> JSONResponse:
        if exc.user_error:
            return error_response(400, str(exc), None, "invalid_request")
        return error_response(500, f"the engine failed on this request: {exc}", None, "engine_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("Unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(
            500, f"internal server error ({type(exc).__name__}); see the server log", None, "internal_error"
        )
