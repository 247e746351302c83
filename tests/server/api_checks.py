"""Checks of the server's answers shared by the server test modules: OpenAI-shaped error bodies, and the
pixels of returned images.

A plain module (not conftest.py) so test files can import it by name."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
from PIL import Image


def assert_error(
    response: httpx.Response, status: int, message_part: str, param: str | None = "<any>"
) -> dict:
    """`response` is an OpenAI-shaped error (`{"error": {message, type, param, code}}`) with `status`, its
    message containing `message_part` and, unless `param` is left out, that `param`. Returns the error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert message_part in body["error"]["message"], body
    if param != "<any>":
        assert body["error"]["param"] == param, body
    return body["error"]


def decode(data: bytes) -> np.ndarray:
    """An encoded image's RGB pixels."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def b64_pixels(b64: str) -> np.ndarray:
    """The RGB pixels of a `b64_json` image."""
    return decode(base64.b64decode(b64))
