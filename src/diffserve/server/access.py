"""Who is calling, and what they may see: the caller's `Principal`, admin-only routes, server paths.

The keys (`--api-key`, several separated by commas: one per client, and `--admin-api-key`) decide:

- no key at all: every caller may do everything and sees every video job, as before keys existed;
- `--api-key` only: each key is a client. A client sees only the /v1/videos jobs it created (other
  jobs are 404 to it, and absent from its list); the admin routes and server paths stay open to every
  key holder, as before (there is no admin key to reserve them for);
- `--admin-api-key` too: the admin routes (POST and DELETE /v1/loras, `AdminOnly`) need the admin
  key (403 with a client key, 401 without any); the admin key sees and deletes every client's jobs; and
  responses to other callers carry no absolute server path (`PathRedactionMiddleware`: the model folder,
  --output-path, --lora-dir and LoRA files, the Python executable become names or paths relative to
  those folders);
- `--admin-api-key` only: callers without a key use the server as before, one anonymous client; the
  admin routes need the admin key.

`ApiKeyMiddleware` (middleware.py) decides the principal of each request and leaves it in the request's
scope; a route reads it as a parameter annotated `Caller`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diffserve.server.errors import ApiError

#: The key of the request scope's `state` that holds the caller's Principal.
PRINCIPAL_STATE = "principal"


@dataclass(frozen=True)
class Principal:
    """A caller as the keys identify it. `owner`: whose /v1/videos jobs it creates and sees ("" for
    callers without a client key); `admin`: may use the admin routes and see server paths; `all_jobs`:
    sees every client's jobs (the admin key; everyone on a server without keys)."""

    owner: str
    admin: bool
    all_jobs: bool

    def sees(self, owner: str) -> bool:
        """Whether a job created by `owner` exists for this caller. Jobs of callers without a client key
        (made before the server had keys, or by anonymous callers) are the admins' too."""
        return self.all_jobs or owner == self.owner or (owner == "" and self.admin)

    def visible_owners(self) -> set[str] | None:
        """The owners whose jobs this caller sees; None: every one."""
        if self.all_jobs:
            return None
        return {self.owner, ""} if self.admin else {self.owner}


#: The caller of a server without keys: everything, as before keys existed.
OPEN = Principal("", admin=True, all_jobs=True)


def parse_api_keys(text: str) -> list[str]:
    """`--api-key`'s keys: comma-separated, each stripped (a key read from a file often ends in a newline);
    empty ones dropped."""
    return [key.strip() for key in text.split(",") if key.strip()]


def key_owner(key: str) -> str:
    """The owner recorded for the jobs of `key`: a digest, never the key itself."""
    return "key:" + hashlib.sha256(b"diffserve-owner\0" + key.encode()).hexdigest()[:24]


def principal_of(request: Request) -> Principal:
    """The caller of `request` (OPEN when the server has no keys: no middleware set one)."""
    principal = request.scope.get("state", {}).get(PRINCIPAL_STATE)
    return principal if isinstance(principal, Principal) else OPEN


async def _caller(request: Request) -> Principal:
    return principal_of(request)


#: A route parameter annotated `Caller` receives the caller's Principal.
Caller = Annotated[Principal, Depends(_caller)]


async def require_admin(request: Request) -> None:
    """The dependency of admin routes: 401 without a key, 403 with a key that is not the admin key."""
    principal = principal_of(request)
    if principal.admin:
        return
    if principal.owner:
        message = "this route needs the admin key (--admin-api-key); a client key may not use it"
        raise ApiError(403, message, code="admin_key_required")
    message = "this route needs the admin key: send it as 'Authorization: Bearer <admin key>'"
    raise ApiError(401, message, code="admin_key_required", headers={"WWW-Authenticate": "Bearer"})


#: `dependencies=[AdminOnly]` on a route (or a router) makes it an admin route.
AdminOnly = Depends(require_admin)


# ------------------------------------------------------------------------------------------ server paths

#: JSON keys whose values are server paths: an absolute one left after `PathRedactor.text` is cut to its
#: last part.
PATH_KEYS = frozenset(
    {"path", "model_path", "output_path", "lora_dir", "transformer_weights", "python_executable", "file"}
)
#: Responses larger than this (base64 images) get the text replacement only, not the JSON walk.
MAX_WALKED_BYTES = 1 << 20
#: What ends a path in text (JSON quotes, spaces, punctuation around a path in a message).
_PATH_END = r"""\s"'<>|;,()\[\]{}"""


class PathRedactor:
    """Turns the server's absolute paths in a response into what a client may see: a path under one of
    `roots` becomes relative to it (the root itself its folder name); with the most specific root first."""

    def __init__(self, roots: Iterable[str]) -> None:
        kept = {os.path.normpath(root) for root in roots if root and os.path.isabs(root)}
        kept = {root for root in kept if root != os.sep and len(Path(root).parts) > 1}
        self.roots = sorted(kept, key=len, reverse=True)
        self._patterns = [
            (
                re.compile(r"(?<![\w./-])" + re.escape(root) + rf"(/[^{_PATH_END}]*)?(?=[{_PATH_END}:]|$)"),
                Path(root).name or root,
            )
            for root in self.roots
        ]

    def text(self, text: str) -> str:
        for pattern, name in self._patterns:
            text = pattern.sub(lambda m, name=name: (m.group(1) or "/").lstrip("/") or name, text)
        return text

    def value(self, value: Any, key: str | None = None) -> Any:
        """A decoded JSON value with every string redacted; values of PATH_KEYS cut to their last part
        when still absolute."""
        if isinstance(value, str):
            value = self.text(value)
            if key in PATH_KEYS and os.path.isabs(value):
                value = os.path.basename(value.rstrip("/")) or "-"
            return value
        if isinstance(value, dict):
            return {k: self.value(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(item, key) for item in value]
        return value

    def body(self, body: bytes) -> bytes:
        """A JSON response body, redacted."""
        text = self.text(body.decode("utf-8", "surrogateescape"))
        if len(text) <= MAX_WALKED_BYTES and '"/' in text:
            try:
                decoded = json.loads(text)
            except ValueError:
                pass
            else:
                walked = self.value(decoded)
                if walked != decoded:
                    text = json.dumps(walked, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "surrogateescape")


def server_path_roots(
    model_path: str, output_path: str, lora_dir: str | None, files: Iterable[str]
) -> list[str]:
    """The folders whose paths `PathRedactor` hides: the model's, --output-path, --lora-dir, those of
    `files` (start-up LoRAs, --transformer-weights), the Python installation's, the working directory and
    the home folder; each as given and with its links resolved."""
    roots = [model_path, output_path, lora_dir or "", *(str(Path(f).parent) for f in files)]
    roots += [os.path.dirname(sys.executable), sys.prefix, sys.base_prefix, sys.exec_prefix, os.getcwd()]
    roots.append(str(Path.home()))
    out = []
    for root in roots:
        if not root:
            continue
        path = Path(root).expanduser()
        out.append(str(path.absolute()))
        with contextlib.suppress(OSError, RuntimeError):
            out.append(str(path.resolve()))
    return out


class PathRedactionMiddleware:
    """JSON responses and event streams (each event's text) to callers that are not admins carry no server
    path (`PathRedactor`); other responses (images, MP4s) pass untouched. Inside ApiKeyMiddleware, which
    sets the caller."""

    def __init__(self, app: ASGIApp, redactor: PathRedactor) -> None:
        self.app, self.redactor = app, redactor

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        principal = scope.get("state", {}).get(PRINCIPAL_STATE)
        if (
            scope["type"] not in ("http", "websocket")
            or not isinstance(principal, Principal)
            or principal.admin
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # /v1/realtime/videos: each JSON text message, redacted

            async def redacting_ws_send(message: Message) -> None:
                if message["type"] == "websocket.send" and message.get("text"):
                    text = self.redactor.body(message["text"].encode("utf-8", "surrogateescape"))
                    message = {**message, "text": text.decode("utf-8", "surrogateescape")}
                await send(message)

            await self.app(scope, receive, redacting_ws_send)
            return
        start: Message | None = None
        chunks: list[bytes] = []
        events = False  # an event stream: each event is redacted as it goes

        async def redacting_send(message: Message) -> None:
            nonlocal start, events
            if message["type"] == "http.response.start":
                content_type = MutableHeaders(scope=message).get("content-type", "")
                if content_type.startswith("application/json"):
                    start = message  # held until the whole body is here
                    return
                events = content_type.startswith("text/event-stream")
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = self.redactor.body(b"".join(chunks))
                MutableHeaders(scope=start)["content-length"] = str(len(body))
                await send(start)
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            elif message["type"] == "http.response.body" and events and message.get("body"):
                text = self.redactor.text(message["body"].decode("utf-8", "surrogateescape"))
                message = {**message, "body": text.encode("utf-8", "surrogateescape")}
            await send(message)

        await self.app(scope, receive, redacting_send)
