"""A small HTTP client for a running diffserve server, on the standard library only.

The pack runs inside ComfyUI's process, which may not have `requests` and must not import diffserve, so
this speaks the server's OpenAI-compatible routes with `urllib`. Every failure becomes a `DiffserveError`
whose text is what ComfyUI shows the user: the server's own error message (OpenAI's JSON shape,
`{"error": {"message", "param", ...}}`) with the status and route, or why the server could not be reached.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass

#: The server's own variable for its key (`DIFFSERVE_API_KEY=KEY diffserve serve`); read here when a
#: node's api_key is empty, so the key need not be typed into a workflow (ComfyUI saves widget values
#: into every output PNG).
API_KEY_ENV = "DIFFSERVE_API_KEY"


class DiffserveError(RuntimeError):
    """The server answered with an error (`status` > 0, its `param` when it named one), or could not be
    reached (`status` 0)."""

    def __init__(self, message: str, status: int = 0, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class UploadFile:
    """One file part of a multipart body."""

    field: str
    filename: str
    data: bytes
    content_type: str = "image/png"


def normalize_base_url(url: str) -> str:
    """`url` without trailing slashes or a trailing `/v1` (users paste OpenAI's base URL too); only http
    and https URLs with a host are accepted."""
    url = url.strip().rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise DiffserveError(f"server_url must be an http(s) URL such as http://127.0.0.1:30000, got {url!r}")
    return url


def error_text(status: int, body: bytes) -> tuple[str, str | None]:
    """The message (and param) of an error answer: OpenAI's JSON error, else the body's text."""
    try:
        error = json.loads(body)["error"]
        return str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", errors="replace").strip()
        return (text[:2000] or f"HTTP {status} with an empty body"), None


def multipart_body(fields: dict[str, str], files: list[UploadFile]) -> tuple[bytes, str]:
    """A multipart/form-data body of text `fields` and `files`, and its Content-Type."""
    boundary = f"diffserve-{uuid.uuid4().hex}"
    chunks: list[bytes] = []
    for name, value in fields.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
        chunks += [head.encode(), value.encode("utf-8"), b"\r\n"]
    for upload in files:
        head = (
            f"--{boundary}\r\nContent-Disposition: form-data; "
            f'name="{upload.field}"; filename="{upload.filename}"\r\n'
            f"Content-Type: {upload.content_type}\r\n\r\n"
        )
        chunks += [head.encode(), upload.data, b"\r\n"]
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


class DiffserveClient:
    """Requests to one server. `api_key` empty: the DIFFSERVE_API_KEY environment variable if set, else
    no key (a server started without one accepts any). `timeout_s`: how long one request may wait for
    the server's answer (generations answer when the images are done)."""

    def __init__(self, server_url: str, api_key: str = "", timeout_s: float = 600.0) -> None:
        self.base_url = normalize_base_url(server_url)
        self.api_key = api_key.strip() or os.environ.get(API_KEY_ENV, "").strip()
        self.timeout_s = timeout_s

    def get_json(self, path: str) -> dict:
        return json.loads(self.request("GET", path))

    def post_json(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode("utf-8")
        return json.loads(self.request("POST", path, data, "application/json"))

    def post_multipart(self, path: str, fields: dict[str, str], files: list[UploadFile]) -> dict:
        data, content_type = multipart_body(fields, files)
        return json.loads(self.request("POST", path, data, content_type))

    def delete(self, path: str) -> dict:
        return json.loads(self.request("DELETE", path))

    def request(
        self, method: str, path: str, data: bytes | None = None, content_type: str | None = None
    ) -> bytes:
        """The answer's body; DiffserveError for an error status or an unreachable server."""
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = f"{self.base_url}{path}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                message, param = error_text(exc.code, exc.read())
            named = f" (param: {param})" if param else ""
            raise DiffserveError(
                f"diffserve server answered {exc.code} to {method} {path}: {message}{named}", exc.code, param
            ) from None
        except urllib.error.URLError as exc:
            raise DiffserveError(
                f"cannot reach the diffserve server at {self.base_url} ({exc.reason}); start it with "
                "`diffserve serve --port 30000` or fix server_url"
            ) from None
        except TimeoutError:
            raise DiffserveError(
                f"no answer from the diffserve server at {self.base_url} to {method} {path} within "
                f"{self.timeout_s:g} s (timeout_s)"
            ) from None
