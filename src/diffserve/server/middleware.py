"""HTTP concerns before routing, as plain ASGI middleware (they never buffer or break disconnects):
request id + access log + per-route metrics, API-key check, request-body size limit."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Sequence
from urllib.parse import parse_qs

from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diffserve.server.access import PRINCIPAL_STATE, Principal, key_owner, parse_api_keys
from diffserve.server.errors import error_response
from diffserve.server.metrics import ServerMetrics

access_logger = logging.getLogger("diffserve.access")

#: Status logged when the client went away before a response was sent (nginx's convention).
CLIENT_CLOSED_REQUEST = 499

#: Paths that never need the API key: probes of load balancers and Prometheus, and the web playground's
#: static files (webui_routes.py; the page asks for the key itself).
OPEN_PATHS = frozenset(
    {"/health", "/health_generate", "/metrics", "/", "/favicon.ico"}
    | {f"/webui/{name}" for name in ("index.html", "app.js", "style.css", "favicon.svg")}
)
_IMAGE_CONTENT_PREFIX = "/v1/images/"
_IMAGE_CONTENT_SUFFIX = "/content"

#: Methods labelled by name in `diffserve_http_requests_total` (any other is "other": bounded labels).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})
MAX_LOGGED_CHARS = 1024  # longest client-supplied value in the access log (the rest is elided)
#: What could forge or garble a log line: C0/C1 controls, DEL, U+2028/9, and the backslash (unambiguous).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return "\\\\" if code == 0x5C else f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def loggable(value: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """`value` (client-supplied) safe for one log line: controls escaped (`\\xNN`), at most `limit` chars."""
    if len(value) > limit:
        value = value[:limit] + f"...({len(value) - limit} more)"
    return _UNSAFE.sub(_escape_char, value)


def content_token(api_key: str, image_id: str) -> str:
    """The `?token=` that lets a `url` response be fetched without the API key (a browser, an <img>);
    the key stripped, as ApiKeyMiddleware strips it."""
    return hmac.new(api_key.strip().encode(), image_id.encode(), hashlib.sha256).hexdigest()[:32]


class RequestContextMiddleware:
    """Outermost layer: gives each request an id (X-Request-Id), counts it and logs one access line."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            code = status if status is not None else CLIENT_CLOSED_REQUEST
            # Bounded labels only: the route template (never the path), a known method.
            route_path = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
            self.metrics.http_requests.labels(method, route_path, str(code)).inc()
            client = scope.get("client")
            peer = loggable(f"{client[0]}:{client[1]}") if client else "-"
            seconds = time.perf_counter() - start
            method, path = loggable(scope["method"]), loggable(scope["path"])
            access_logger.info("%s %s %s %d %.3fs client=%s", request_id, method, path, code, seconds, peer)


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on everything but OPEN_PATHS, compared in constant time; it also decides
    the caller's `Principal` (access.py), left in the request scope for the routes. `api_key`: the clients'
    keys, comma-separated (or a list); `admin_api_key`: the admin key. With an admin key only, callers
    without it are let through as one anonymous client. Image URLs handed out by the server also work with
    their `?token=`. Keys are stripped (one read from a file often ends in a newline, and the client's token
    is stripped too); an empty key is refused."""

    def __init__(
        self, app: ASGIApp, api_key: str | Sequence[str] | None = None, admin_api_key: str | None = None
    ) -> None:
        keys = parse_api_keys(api_key) if isinstance(api_key, str) else [k.strip() for k in api_key or ()]
        if api_key is not None and not (keys and all(keys)):
            raise ValueError("the API key must not be empty or only whitespace")
        admin = None if admin_api_key is None else admin_api_key.strip()
        if admin is not None and not admin:
            raise ValueError("the admin API key must not be empty or only whitespace")
        if not keys and admin is None:
            raise ValueError("ApiKeyMiddleware needs an API key or an admin API key")
        self.app = app
        #: Without an admin key, a client key may use the admin routes, as before there was one.
        self._keys = [
            (key.encode(), Principal(key_owner(key), admin=admin is None, all_jobs=False)) for key in keys
        ]
        if admin is not None:
            self._keys.append((admin.encode(), Principal(key_owner(admin), admin=True, all_jobs=True)))
        #: Who a caller without a valid key is where no client key is needed (None: refused, 401).
        self._anonymous = None if keys else Principal("", admin=False, all_jobs=False)
        #: The key image URLs' `?token=` is made with (image_routes.py signs with the first client key).
        self.api_key = keys[0] if keys else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        principal, problem = self._principal(scope)
        if principal is None and (scope["path"] in OPEN_PATHS or self._image_token_matches(scope)):
            principal, problem = Principal("", admin=False, all_jobs=False), None
        if principal is not None:
            scope.setdefault("state", {})[PRINCIPAL_STATE] = principal
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # refused before the handshake: the client sees HTTP 403
            await send({"type": "websocket.close", "code": 1008, "reason": problem[:120]})
            return
        headers = {"WWW-Authenticate": "Bearer"}
        await error_response(401, problem, None, "invalid_api_key", headers)(scope, receive, send)

    def _principal(self, scope: Scope) -> tuple[Principal | None, str]:
        """The caller its key makes it (or the anonymous one, where allowed), else None and what is wrong."""
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode()
        found = None
        for key, principal in self._keys:  # every key compared, in constant time each
            if hmac.compare_digest(given, key) and scheme.lower() == "bearer":
                found = principal
        if found is not None:
            return found, ""
        if self._anonymous is not None:
            return self._anonymous, ""
        if not auth:
            return None, "missing API key: send it as 'Authorization: Bearer <key>'"
        return None, "invalid API key"

    def _image_token_matches(self, scope: Scope) -> bool:
        path = scope["path"]
        if self.api_key is None or not (
            path.startswith(_IMAGE_CONTENT_PREFIX) and path.endswith(_IMAGE_CONTENT_SUFFIX)
        ):
            return False
        image_id = path[len(_IMAGE_CONTENT_PREFIX) : -len(_IMAGE_CONTENT_SUFFIX)]
        given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
        return bool(given) and hmac.compare_digest(
            given.encode(), content_token(self.api_key, image_id).encode()
        )


#: A request body that stops arriving for this long gets 408: a client trickling or stalling its body
#: holds no connection (nor the request's buffers) for longer.
BODY_IDLE_TIMEOUT_S = 8.0


class BodySizeLimitMiddleware:
    """413 for bodies over the limit: at once from Content-Length, or while a chunked body streams in;
    408 when the body stalls for `idle_timeout` seconds (--body-timeout).
    `path_limits` maps a path to its own limit instead of `max_bytes`, and the flags that set it."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: dict[str, tuple[int, str]] | None = None,
        idle_timeout: float | None = None,
    ) -> None:  # fmt: skip
        self.app, self.max_bytes, self.path_limits = app, max_bytes, dict(path_limits or {})
        self.idle_timeout = idle_timeout  # --body-timeout; None: BODY_IDLE_TIMEOUT_S

    @staticmethod
    def _message(size: str, limit: int, flags: str) -> str:
        return f"request body of {size} exceeds the server's limit of {limit} bytes ({flags})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, flags = self.path_limits.get(scope["path"], (self.max_bytes, "--max-body-bytes"))
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            message = self._message(f"{int(length)} bytes", limit, flags)
            await error_response(413, message, None, "request_too_large")(scope, receive, send)
            return
        received, body_done = 0, False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # later receives wait for the client to leave: no deadline on those
                return await receive()
            timeout = BODY_IDLE_TIMEOUT_S if self.idle_timeout is None else self.idle_timeout
            try:
                message = await asyncio.wait_for(receive(), timeout)
            except asyncio.TimeoutError:
                message = f"request body stalled: nothing received for {timeout:g} s (--body-timeout)"
                raise HTTPException(408, message) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    raise HTTPException(413, self._message(f"more than {limit} bytes", limit, flags))
            return message

        await self.app(scope, limited_receive, send)
