"""Issue 17 item 8: a URL download has one total deadline (`ImageInputLimits.url_timeout_s`), enforced
even when the peer trickles bytes, which restarts a per-read socket timeout with every byte.

A local server on 127.0.0.1 sends its answer one byte every `BYTE_EVERY_S` seconds, far longer in all
than the deadline. The address check would refuse loopback by design; only it is bypassed, as in
test_image_inputs.py. What shows the deadline held is the server's side: the client hung up before the
answer was complete (without the deadline it reads to the end), and the error is the 400 naming `image`.
"""

from __future__ import annotations

import io
import socketserver
import threading
from collections.abc import Iterator

import pytest
from PIL import Image

import diffserve.image_inputs as image_inputs
from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import ImageInputLimits, load_image
from diffserve.server.errors import as_api_error

BYTE_EVERY_S = 0.5
DEADLINE_S = 1.0
SAFETY_S = 20.0  # only so that a broken deadline fails the test instead of hanging it


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


BODY = _png()
HEAD_WITH_LENGTH = (
    f"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {len(BODY)}\r\n\r\n".encode()
)
HEAD_WITHOUT_LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nConnection: close\r\n\r\n"
#: Path -> (sent at once, then trickled one byte at a time).
ANSWERS = {
    "/slow-headers": (b"", HEAD_WITH_LENGTH + BODY),
    "/slow-body": (HEAD_WITH_LENGTH, BODY),
    "/slow-body-no-length": (HEAD_WITHOUT_LENGTH, BODY),
}


class _Trickler(socketserver.BaseRequestHandler):
    """Answers as `ANSWERS` says; records how much it sent before the client hung up."""

    def handle(self) -> None:
        server: _TrickleServer = self.server  # type: ignore[assignment]
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = self.request.recv(4096)
            if not chunk:
                return
            request += chunk
        path = request.split(b" ", 2)[1].decode()
        first, trickled = ANSWERS[path]
        try:
            self.request.sendall(first)
            for i in range(len(trickled)):
                if server.stop.wait(server.byte_every_s):
                    return
                self.request.sendall(trickled[i : i + 1])
            server.finished.set()
        except OSError:  # the client hung up
            server.client_left.set()
            return


class _TrickleServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Trickler)
        self.stop, self.finished, self.client_left = threading.Event(), threading.Event(), threading.Event()
        self.byte_every_s = BYTE_EVERY_S


@pytest.fixture
def trickler(monkeypatch: pytest.MonkeyPatch) -> Iterator[_TrickleServer]:
    server = _TrickleServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(image_inputs, "_check_host", lambda host, port, *, param: ["127.0.0.1"])
    yield server
    server.stop.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("path", sorted(ANSWERS))
def test_a_trickling_peer_is_cut_off_at_the_deadline(trickler: _TrickleServer, path: str) -> None:
    assert len(ANSWERS[path][1]) * BYTE_EVERY_S > 5 * DEADLINE_S  # the whole answer takes far longer
    url = f"http://127.0.0.1:{trickler.server_address[1]}{path}"
    with pytest.raises(InvalidRequestError, match="timed out") as info:
        load_image(url, allow_urls=True, limits=ImageInputLimits(url_timeout_s=DEADLINE_S))
    assert f"within {DEADLINE_S:g} s" in str(info.value)
    answer = as_api_error(info.value)
    assert (answer.status, answer.param) == (400, "image")
    # The server's side: the client hung up mid-answer; it never got to send the whole answer.
    assert trickler.client_left.wait(SAFETY_S), "the server never saw the client hang up"
    assert not trickler.finished.is_set()


def test_a_prompt_peer_is_fetched_within_the_deadline(trickler: _TrickleServer) -> None:
    """The deadline does not cut off a download that finishes in time (the trickle made instant)."""
    trickler.byte_every_s = 0.0
    url = f"http://127.0.0.1:{trickler.server_address[1]}/slow-body"
    image = load_image(url, allow_urls=True, limits=ImageInputLimits(url_timeout_s=DEADLINE_S * 5))
    assert image.size == (4, 4)
