"""`diffserve.image_inputs.load_image`: sources, limits, format allow-list and URL safety.

No network: URL tests either never connect (refused before connecting, with `socket.getaddrinfo` faked
where a host name is involved) or talk to a throwaway HTTP server on 127.0.0.1 with the private-address
check patched out for that test only.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image

import diffserve.image_inputs as image_inputs
from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import ImageInputLimits, ImageTooLargeError, load_image, load_images

# ------------------------------------------------------------------------------------------------ helpers


def _encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _png(size=(8, 6), color=(200, 10, 30), mode="RGB") -> bytes:
    return _encode(Image.new(mode, size, color), "PNG")


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width`x`height` but whose pixel data is garbage: decoding it would fail."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", b"not zlib data")
        + _png_chunk(b"IEND", b"")
    )


def _fake_getaddrinfo(mapping: dict[str, list[str]]):
    def fake(host, port, *args, **kwargs):
        if host not in mapping:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for addr in mapping[host]:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sockaddr = (addr, port, 0, 0) if family == socket.AF_INET6 else (addr, port)
            out.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
        return out

    return fake


# ------------------------------------------------------------------------------------------------ sources


def test_raw_bytes_and_bytearray():
    img = load_image(_png((8, 6)))
    assert isinstance(img, Image.Image)
    assert img.mode == "RGB" and img.size == (8, 6)
    assert img.getpixel((0, 0)) == (200, 10, 30)
    assert load_image(bytearray(_png())).size == (8, 6)
    assert load_image(memoryview(_png())).size == (8, 6)


def test_path_str_and_pathlib(tmp_path: Path):
    p = tmp_path / "in.png"
    p.write_bytes(_png((5, 7)))
    assert load_image(p).size == (5, 7)
    assert load_image(str(p)).size == (5, 7)


def test_data_url():
    img = load_image(_data_url(_png((3, 4))))
    assert img.size == (3, 4) and img.mode == "RGB"
    # Media type and whitespace/newlines in the payload are tolerated; content decides the format.
    b64 = base64.b64encode(_encode(Image.new("RGB", (2, 2)), "JPEG")).decode()
    wrapped = "\n".join(b64[i : i + 20] for i in range(0, len(b64), 20))
    assert load_image(f"DATA:image/jpeg;base64,{wrapped}").size == (2, 2)
    assert load_image("data:;base64," + b64).size == (2, 2)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_allowed_formats_decode(fmt):
    img = load_image(_encode(Image.new("RGB", (9, 5), (0, 128, 255)), fmt))
    assert img.size == (9, 5) and img.mode == "RGB"


def test_gif_first_frame():
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert load_image(buf.getvalue()).getpixel((0, 0)) == (255, 0, 0)


def test_rgba_and_palette_are_converted_to_rgb():
    rgba = load_image(_png((3, 3), (10, 20, 30, 0), mode="RGBA"))
    assert rgba.mode == "RGB" and rgba.getpixel((1, 1)) == (10, 20, 30)  # alpha dropped, not composited
    gray = load_image(_png((3, 3), 77, mode="L"))
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (77, 77, 77)


def test_exif_orientation_applied():
    img = Image.new("RGB", (4, 2), (0, 255, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    out = load_image(_encode(img, "JPEG", exif=exif.tobytes()))
    assert out.size == (2, 4)


def test_param_name_is_propagated():
    with pytest.raises(InvalidRequestError) as ei:
        load_image(b"nope", param="mask")
    assert ei.value.param == "mask"
    assert str(ei.value).startswith("mask:")


def test_unsupported_source_type():
    with pytest.raises(InvalidRequestError, match="expected a file path, bytes"):
        load_image(123)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- bad inputs


def test_path_does_not_exist(tmp_path: Path):
    with pytest.raises(InvalidRequestError, match="not an existing file") as ei:
        load_image(str(tmp_path / "missing.png"))
    assert ei.value.param == "image"
    assert not isinstance(ei.value, ImageTooLargeError)


def test_path_is_a_directory(tmp_path: Path):
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        load_image(tmp_path)


def test_bare_base64_string_gets_a_hint_not_a_crash():
    # Treated as a path; very long names (ENAMETOOLONG) must still be a clean user error.
    bare = base64.b64encode(_png((64, 64))).decode() * 20
    with pytest.raises(InvalidRequestError, match="data URL"):
        load_image(bare)
    with pytest.raises(InvalidRequestError):
        load_image("bad\x00path.png")


def test_not_an_image():
    with pytest.raises(InvalidRequestError, match="not a recognised image") as ei:
        load_image(b"hello, this is text")
    assert "PNG, JPEG, WEBP, BMP, GIF" in str(ei.value)


def test_truncated_image_is_corrupt():
    data = _encode(Image.effect_noise((64, 64), 50).convert("RGB"), "PNG")
    with pytest.raises(InvalidRequestError, match="corrupt or truncated") as ei:
        load_image(data[: len(data) // 2])
    assert not isinstance(ei.value, ImageTooLargeError)


@pytest.mark.parametrize("fmt", ["TIFF", "ICO"])
def test_unsupported_format(fmt):
    data = _encode(Image.new("RGB", (16, 16)), fmt)
    with pytest.raises(InvalidRequestError, match="allowed format"):
        load_image(data)


def test_allowed_formats_can_be_narrowed():
    limits = ImageInputLimits(allowed_formats=("png",))
    assert limits.allowed_formats == ("PNG",)
    assert load_image(_png(), limits=limits).size == (8, 6)
    with pytest.raises(InvalidRequestError, match="allowed formats: PNG"):
        load_image(_encode(Image.new("RGB", (4, 4)), "JPEG"), limits=limits)


@pytest.mark.parametrize(
    "url, match",
    [
        ("data:image/png;base64,@@@not base64@@@", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # bad padding
        ("data:image/png;base64,", "no image data"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64", "no ','"),
        ("data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("data:image/png;base64,aGVsbG8=", "not a recognised image"),
    ],
)
def test_bad_data_urls(url, match):
    with pytest.raises(InvalidRequestError, match=match):
        load_image(url)


# ------------------------------------------------------------------------------------------------ limits


def test_limits_dataclass():
    limits = ImageInputLimits()
    assert limits.max_bytes == 20 * 1024 * 1024
    assert limits.max_pixels == 4096 * 4096
    assert limits.url_timeout_s == 10.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_bytes = 1  # type: ignore[misc]
    for bad in ({"max_bytes": 0}, {"max_pixels": -1}, {"url_timeout_s": 0}, {"allowed_formats": ()}):
        with pytest.raises(ValueError):
            ImageInputLimits(**bad)
    with pytest.raises(ValueError, match="TIFF"):
        ImageInputLimits(allowed_formats=("PNG", "TIFF"))


def test_byte_limit_bytes_path_and_data_url(tmp_path: Path):
    data = _png((32, 32))
    limits = ImageInputLimits(max_bytes=len(data) - 1)
    with pytest.raises(ImageTooLargeError, match="over the limit") as ei:
        load_image(data, limits=limits, param="image[0]")
    assert isinstance(ei.value, InvalidRequestError) and ei.value.param == "image[0]"
    p = tmp_path / "big.png"
    p.write_bytes(data)
    with pytest.raises(ImageTooLargeError):
        load_image(p, limits=limits)
    with pytest.raises(ImageTooLargeError):
        load_image(_data_url(data), limits=limits)
    assert load_image(data, limits=ImageInputLimits(max_bytes=len(data))).size == (32, 32)


def test_data_url_size_checked_before_base64_decoding(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("b64decode must not run for an oversized payload")

    monkeypatch.setattr(image_inputs.base64, "b64decode", boom)
    with pytest.raises(ImageTooLargeError):
        load_image("data:image/png;base64," + "A" * 4000, limits=ImageInputLimits(max_bytes=1000))


def test_pixel_limit_small_image():
    with pytest.raises(ImageTooLargeError, match="64x64"):
        load_image(_png((64, 64)), limits=ImageInputLimits(max_pixels=64 * 64 - 1))
    assert load_image(_png((64, 64)), limits=ImageInputLimits(max_pixels=64 * 64)).size == (64, 64)


def test_pixel_limit_checked_from_header_without_decoding():
    # 5000x5000 = 25M pixels: over the default 16.7M limit, under Pillow's own bomb threshold. The pixel
    # data is garbage, so reaching the decoder would give "corrupt" instead of ImageTooLargeError.
    with pytest.raises(ImageTooLargeError, match="5000x5000"):
        load_image(_png_header_only(5000, 5000))
    # Sanity: within the limit the same garbage does reach the decoder and fails there.
    with pytest.raises(InvalidRequestError, match="corrupt") as ei:
        load_image(_png_header_only(5000, 5000), limits=ImageInputLimits(max_pixels=10**8))
    assert not isinstance(ei.value, ImageTooLargeError)


def test_decompression_bomb_is_too_large():
    # 100000x100000 trips Pillow's DecompressionBombError inside Image.open; converted, nothing global set.
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageTooLargeError, match="decompression bomb"):
        load_image(_png_header_only(100_000, 100_000), limits=ImageInputLimits(max_pixels=10**11))
    # 12000x12000 is between Pillow's warning and error thresholds: the warning is converted too.
    with pytest.raises(ImageTooLargeError):
        load_image(_png_header_only(12_000, 12_000), limits=ImageInputLimits(max_pixels=10**11))
    assert before == Image.MAX_IMAGE_PIXELS


# -------------------------------------------------------------------------------------------- URL policy


def test_url_refused_when_not_allowed(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("must not resolve or connect")

    monkeypatch.setattr(image_inputs.socket, "getaddrinfo", no_network)
    for url in ("http://example.com/a.png", "https://example.com/a.png", "HTTPS://example.com/a.png"):
        with pytest.raises(InvalidRequestError, match="--allow-url-images") as ei:
            load_image(url)
        assert not isinstance(ei.value, ImageTooLargeError)


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "file:///etc/passwd", "gopher://example.com/", "s3://bucket/key.png"]
)
def test_non_http_scheme_refused(url):
    for allow in (False, True):
        with pytest.raises(InvalidRequestError, match="scheme"):
            load_image(url, allow_urls=allow)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "10.1.2.3",
        "192.168.0.10",
        "172.16.5.4",
        "169.254.169.254",  # cloud metadata, link-local
        "100.64.0.1",  # shared address space (not global)
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "[fe80::1]",
        "[fc00::1]",
    ],
)
def test_private_ip_literals_refused(monkeypatch, host):
    def no_connect(*a, **k):
        raise AssertionError("must not connect")

    monkeypatch.setattr(image_inputs, "_connection", no_connect)
    with pytest.raises(InvalidRequestError, match="private, loopback"):
        load_image(f"http://{host}:8080/x.png", allow_urls=True)


def test_localhost_name_refused(monkeypatch):
    monkeypatch.setattr(
        image_inputs.socket, "getaddrinfo", _fake_getaddrinfo({"localhost": ["127.0.0.1", "::1"]})
    )
    with pytest.raises(InvalidRequestError, match="'localhost' resolves to 127.0.0.1"):
        load_image("http://localhost/x.png", allow_urls=True)


def test_all_resolved_addresses_are_checked(monkeypatch):
    monkeypatch.setattr(
        image_inputs.socket,
        "getaddrinfo",
        _fake_getaddrinfo({"mixed.example": ["93.184.216.34", "10.0.0.7"]}),
    )
    monkeypatch.setattr(image_inputs, "_connection", lambda *a: pytest.fail("must not connect"))
    with pytest.raises(InvalidRequestError, match="10.0.0.7"):
        load_image("https://mixed.example/x.png", allow_urls=True)


def test_unresolvable_host(monkeypatch):
    monkeypatch.setattr(image_inputs.socket, "getaddrinfo", _fake_getaddrinfo({}))
    with pytest.raises(InvalidRequestError, match="could not resolve"):
        load_image("https://nope.invalid/x.png", allow_urls=True)


@pytest.mark.parametrize(
    "url, match",
    [
        ("https://user:pw@example.com/x.png", "credentials"),
        ("http:///x.png", "no host"),
        ("http://example.com:99999/x.png", "malformed"),
    ],
)
def test_malformed_urls(monkeypatch, url, match):
    monkeypatch.setattr(
        image_inputs.socket, "getaddrinfo", _fake_getaddrinfo({"example.com": ["93.184.216.34"]})
    )
    with pytest.raises(InvalidRequestError, match=match):
        load_image(url, allow_urls=True)


def test_public_host_is_fetched_from_the_checked_address(monkeypatch, local_http):
    """The download connects to the address the check approved (not a second DNS answer), asks for the
    URL's host, and passes the fetch deadline as the socket timeout."""
    resolve = {"cdn.example": ["93.184.216.34"], "127.0.0.1": ["127.0.0.1"]}  # the latter: the test's own
    monkeypatch.setattr(image_inputs.socket, "getaddrinfo", _fake_getaddrinfo(resolve))
    seen = {}
    real_connect = socket.create_connection

    def connect(address, timeout, source_address=None):
        seen["address"], seen["timeout"] = address, timeout
        return real_connect(("127.0.0.1", local_http.server_address[1]), timeout)

    monkeypatch.setattr(image_inputs.socket, "create_connection", connect)
    img = load_image("http://cdn.example/ok.png", allow_urls=True, limits=ImageInputLimits(url_timeout_s=3))
    assert img.size == (10, 4)
    assert seen["address"] == ("93.184.216.34", 80) and 0 < seen["timeout"] <= 3
    assert local_http.RequestHandlerClass.last_host == "cdn.example"


# ------------------------------------------------------------------------------- URL fetch (local server)

_PNG_BODY = _png((10, 4))


class _Handler(http.server.BaseHTTPRequestHandler):
    last_host: str | None = None

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).last_host = self.headers.get("Host")
        if self.path == "/ok.png":
            self._send(200, _PNG_BODY)
        elif self.path == "/big":
            self._send(200, b"\0" * 5000)
        elif self.path == "/big-no-length":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * 5000)
            self.close_connection = True
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(1.5)
            self._send(200, _PNG_BODY)
        else:
            self._send(404, b"nope")

    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def local_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def local_server(monkeypatch, local_http):
    # The loopback server would be refused by design; bypass only the address check for these tests.
    monkeypatch.setattr(image_inputs, "_check_host", lambda host, port, *, param: ["127.0.0.1"])
    return f"http://127.0.0.1:{local_http.server_address[1]}"


def test_url_fetch_ok(local_server):
    img = load_image(f"{local_server}/ok.png", allow_urls=True)
    assert img.size == (10, 4) and img.mode == "RGB"


def test_url_redirect_refused(local_server):
    with pytest.raises(InvalidRequestError, match="redirect") as ei:
        load_image(f"{local_server}/redirect", allow_urls=True)
    assert "169.254.169.254" in str(ei.value)


def test_url_http_error(local_server):
    with pytest.raises(InvalidRequestError, match="HTTP 404"):
        load_image(f"{local_server}/missing", allow_urls=True)


@pytest.mark.parametrize("path", ["/big", "/big-no-length"])
def test_url_byte_limit(local_server, path):
    with pytest.raises(ImageTooLargeError):
        load_image(f"{local_server}{path}", allow_urls=True, limits=ImageInputLimits(max_bytes=1000))


def test_url_timeout(local_server):
    with pytest.raises(InvalidRequestError, match="timed out"):
        load_image(f"{local_server}/slow", allow_urls=True, limits=ImageInputLimits(url_timeout_s=0.3))


def test_a_family_that_reads_no_alpha_gets_rgb_whatever_loaded_the_image() -> None:
    """Input images are loaded with their transparency (`keep_alpha`); a family's validation drops it
    unless its rule keeps it (Qwen-Image-Layered's), so every other family sees the RGB it always saw."""
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.stages.input_validation import ImageInputRule

    rgba = Image.new("RGBA", (16, 16), (10, 20, 30, 0))
    loaded = load_images(rgba, param="image", keep_alpha=True)
    assert loaded[0].mode == "RGBA"
    for keep_alpha, mode in ((False, "RGB"), (True, "RGBA")):
        params = SamplingParams("a fox", input_images=list(loaded))
        ImageInputRule(task="image-edit", min_images=1, max_images=1, keep_alpha=keep_alpha).check(params)
        assert [image.mode for image in params.input_images] == [mode]
        assert params.input_images[0].getpixel((0, 0))[:3] == (10, 20, 30)  # dropped, not composited
