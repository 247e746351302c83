"""Load a user-supplied input image (for image-to-image and edits) into an RGB `PIL.Image.Image`.

Accepted sources, all through `load_image`:

- a local file path (`str` or `pathlib.Path`); the file must exist and be a regular file,
- raw encoded image bytes (`bytes`, `bytearray`, `memoryview`),
- a base64 data URL string (`data:image/png;base64,...`),
- an `http://` or `https://` URL string, only when the caller passes `allow_urls=True` (the server's
  `--allow-url-images`, off by default).

Every problem is an `InvalidRequestError` whose `param` is the name the caller passed (default
`"image"`); inputs over a byte or pixel bound raise its subclass `ImageTooLargeError`, which the server
maps to HTTP 413. Only PNG, JPEG, WEBP, BMP and GIF are decoded (animated GIF/WEBP: the first frame).
The pixel bound is checked against the header size before any pixel data is decoded, and Pillow's
decompression-bomb error/warning are turned into `ImageTooLargeError` without changing global Pillow
settings.

The result has the EXIF orientation applied and is converted with `.convert("RGB")`: an alpha channel is
dropped, not composited onto a background, so fully transparent pixels keep whatever colour they store;
with `keep_alpha`, an image with transparency is RGBA instead (input images, whose alpha the family's
validation drops unless it reads it); with `as_mask` (inpainting masks) an image with transparency is RGBA
and a bilevel, grey, palette or RGB one keeps its mode, as Diffusers' mask processor resizes it
(`diffserve.masks.pipeline_mask`).

URL fetching (`http.client`, no proxies, no redirects) refuses hosts for which any resolved address is
private, loopback, link-local, multicast, reserved, unspecified or otherwise not globally routable, then
connects to one of exactly those checked addresses (so a second DNS answer cannot redirect it; HTTPS
still verifies the certificate against the host name). It reads at most `max_bytes + 1` bytes, and the
whole download - connect, TLS handshake, headers and body - must finish within `url_timeout_s`: a
watchdog shuts the socket down at the deadline, however slowly the peer trickles bytes. Name resolution
itself cannot be interrupted and is bounded only by the system resolver's own timeouts.

`read_image_source` and `decode_image` are `load_image`'s two halves, for callers that run fetching and
decoding in different worker pools (the server does).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import ipaddress
import re
import socket
import ssl
import threading
import time
import urllib.parse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from diffserve.errors import InvalidRequestError
from diffserve.masks import has_alpha

__all__ = [
    "DEFAULT_ALLOWED_FORMATS",
    "ImageInputLimits",
    "ImageTooLargeError",
    "decode_image",
    "load_image",
    "load_images",
    "read_image_source",
]

DEFAULT_ALLOWED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "BMP", "GIF")

_MIB = 1024 * 1024
_CHUNK = 64 * 1024
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class ImageTooLargeError(InvalidRequestError):
    """The input image is over the byte or pixel bound (the server answers 413)."""


@dataclass(frozen=True)
class ImageInputLimits:
    """Bounds on an input image.

    max_bytes: encoded size (file, decoded data URL, or downloaded body).
    max_pixels: width * height, from the header, checked before decoding.
    allowed_formats: Pillow format names that may be decoded.
    url_timeout_s: total deadline of one URL download (connect, TLS, headers and body together).
    """

    max_bytes: int = 20 * _MIB
    max_pixels: int = 4096 * 4096
    allowed_formats: tuple[str, ...] = DEFAULT_ALLOWED_FORMATS
    url_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {self.max_bytes}")
        if self.max_pixels <= 0:
            raise ValueError(f"max_pixels must be > 0, got {self.max_pixels}")
        if self.url_timeout_s <= 0:
            raise ValueError(f"url_timeout_s must be > 0, got {self.url_timeout_s}")
        formats = tuple(f.upper() for f in self.allowed_formats)
        if not formats:
            raise ValueError("allowed_formats must not be empty")
        unknown = [f for f in formats if f not in DEFAULT_ALLOWED_FORMATS]
        if unknown:
            raise ValueError(f"unsupported formats {unknown}; choose from {list(DEFAULT_ALLOWED_FORMATS)}")
        object.__setattr__(self, "allowed_formats", formats)


def load_image(
    source: str | Path | bytes | bytearray | memoryview,
    *,
    param: str = "image",
    allow_urls: bool = False,
    limits: ImageInputLimits | None = None,
    keep_alpha: bool = False,
    as_mask: bool = False,
) -> Image.Image:
    """Load `source` (path, raw bytes, base64 data URL, or - with `allow_urls` - an http(s) URL) as RGB
    (with `keep_alpha`, an image with transparency as RGBA; with `as_mask`, an inpainting mask in the mode
    the pipelines read it in: `loaded_mode`).

    Raises `InvalidRequestError(param=param)` for anything unusable and `ImageTooLargeError` for inputs
    over `limits` (defaults: `ImageInputLimits()`).
    """
    limits = limits if limits is not None else ImageInputLimits()
    data = read_image_source(source, param=param, allow_urls=allow_urls, limits=limits)
    return decode_image(data, param=param, limits=limits, keep_alpha=keep_alpha, as_mask=as_mask)


def read_image_source(
    source: str | Path | bytes | bytearray | memoryview,
    *,
    param: str = "image",
    allow_urls: bool = False,
    limits: ImageInputLimits | None = None,
) -> bytes:
    """The encoded image bytes of `source` (read, base64-decoded or downloaded), within `limits.max_bytes`;
    the first half of `load_image`."""
    limits = limits if limits is not None else ImageInputLimits()
    return _read_source(source, param=param, allow_urls=allow_urls, limits=limits)


def decode_image(
    data: bytes,
    *,
    param: str = "image",
    limits: ImageInputLimits | None = None,
    keep_alpha: bool = False,
    as_mask: bool = False,
) -> Image.Image:
    """Encoded image bytes as RGB (`keep_alpha`, `as_mask`: `loaded_mode`), the pixel count checked from
    the header first; the second half of `load_image`."""
    limits = limits if limits is not None else ImageInputLimits()
    return _decode(data, param=param, limits=limits, keep_alpha=keep_alpha, as_mask=as_mask)


#: Modes a mask keeps when loaded `as_mask`: what Diffusers' mask processor resizes as they are.
MASK_MODES = ("1", "L", "P", "RGB")


def loaded_mode(image: Image.Image, keep_alpha: bool = False, as_mask: bool = False) -> Image.Image:
    """A decoded image as the loaders return it (a new image): RGBA where it has transparency and the
    caller keeps alpha (`keep_alpha`, or `as_mask`); a mask (`as_mask`) in its own mode where that is one
    of `MASK_MODES`; else RGB."""
    if (keep_alpha or as_mask) and has_alpha(image):
        return image.convert("RGBA")
    if as_mask and image.mode in MASK_MODES:
        return image.copy()
    return image.convert("RGB")


# ---------------------------------------------------------------------------------------------- sources


def _read_source(source: object, *, param: str, allow_urls: bool, limits: ImageInputLimits) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        _check_byte_count(len(data), param=param, limits=limits, what="image data")
        return data
    if isinstance(source, Path):
        return _read_path(source, param=param, limits=limits)
    if isinstance(source, str):
        stripped = source.strip()
        lowered = stripped[:16].lower()
        if lowered.startswith("data:"):
            return _read_data_url(stripped, param=param, limits=limits)
        if lowered.startswith(("http://", "https://")):
            if not allow_urls:
                raise InvalidRequestError(
                    f"{param}: image URLs are disabled on this server; send the image as a base64 data URL "
                    "(data:image/png;base64,...) or as an uploaded file instead (the operator can enable "
                    "URLs with --allow-url-images)",
                    param=param,
                )
            return _fetch_url(stripped, param=param, limits=limits)
        if _SCHEME_RE.match(stripped):
            scheme = stripped.split(":", 1)[0]
            raise InvalidRequestError(
                f"{param}: URL scheme {scheme!r} is not supported; use a base64 data URL "
                "(data:image/png;base64,...), raw bytes, a local file path, or an http(s) URL where allowed",
                param=param,
            )
        return _read_path(Path(source), param=param, limits=limits)
    raise InvalidRequestError(
        f"{param}: expected a file path, bytes, a data URL or an http(s) URL, got {type(source).__name__}",
        param=param,
    )


def _check_byte_count(n: int, *, param: str, limits: ImageInputLimits, what: str) -> None:
    if n > limits.max_bytes:
        raise ImageTooLargeError(
            f"{param}: {what} is {_fmt_bytes(n)}, over the limit of {_fmt_bytes(limits.max_bytes)}; "
            "send a smaller or more compressed image",
            param=param,
        )


def _fmt_bytes(n: int) -> str:
    if n >= _MIB:
        return f"{n / _MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} bytes"


def _read_path(path: Path, *, param: str, limits: ImageInputLimits) -> bytes:
    shown = str(path)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    hint = (
        f"{param}: {shown!r} is not an existing file; pass a path to an image file, or a base64 data URL "
        "(data:image/png;base64,...)"
    )
    try:
        if not path.exists():
            raise InvalidRequestError(hint, param=param)
        if not path.is_file():
            raise InvalidRequestError(f"{param}: {shown!r} is not a regular file", param=param)
        size = path.stat().st_size
        _check_byte_count(size, param=param, limits=limits, what="image file")
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)
    except (OSError, ValueError) as e:  # name too long, embedded NUL, permission denied, ...
        raise InvalidRequestError(f"{hint} ({e.__class__.__name__}: {e})", param=param) from None
    _check_byte_count(len(data), param=param, limits=limits, what="image file")
    return data


def _read_data_url(url: str, *, param: str, limits: ImageInputLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise InvalidRequestError(
            f"{param}: malformed data URL (no ','); expected data:image/<format>;base64,<data>", param=param
        )
    meta = header[len("data:") :].split(";")
    media_type = meta[0].strip().lower()
    if "base64" not in (m.strip().lower() for m in meta[1:]):
        raise InvalidRequestError(
            f"{param}: data URL must be base64-encoded; expected data:image/<format>;base64,<data>",
            param=param,
        )
    if media_type and not media_type.startswith("image/"):
        raise InvalidRequestError(
            f"{param}: data URL media type {media_type!r} is not an image type; expected image/png, "
            "image/jpeg, image/webp, image/bmp or image/gif",
            param=param,
        )
    payload = "".join(payload.split())
    # Bound before decoding: base64 expands 3 bytes into 4 characters.
    _check_byte_count(len(payload) // 4 * 3, param=param, limits=limits, what="decoded data URL")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            f"{param}: data URL payload is not valid base64 (check for truncation or URL-safe '-'/'_' "
            "characters; standard base64 with padding is required)",
            param=param,
        ) from None
    if not data:
        raise InvalidRequestError(f"{param}: data URL contains no image data", param=param)
    _check_byte_count(len(data), param=param, limits=limits, what="decoded data URL")
    return data


# ------------------------------------------------------------------------------------------------- URLs


class _Deadline:
    """One download's total deadline. When it passes, the download's sockets are shut down, so a
    blocked connect, TLS handshake, header or body read returns at once however slowly the peer
    trickles bytes: a socket timeout alone restarts with every byte received.

    The watchdog shuts down a duplicate of each socket's descriptor, owned here: the connection's own
    descriptor may already be closed (and its number reused) when the timer fires, a duplicate cannot.
    """

    def __init__(self, seconds: float, addresses: Sequence[str]) -> None:
        self.seconds, self.addresses = seconds, list(addresses)
        self.expired = False
        self._end = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._watched: list[socket.socket] = []
        self._done = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        with self._lock:  # a running `_expire` finishes first; none starts after this
            self._done = True
            for dup in self._watched:
                dup.close()
            self._watched.clear()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            for dup in self._watched:
                with contextlib.suppress(OSError):
                    dup.shutdown(socket.SHUT_RDWR)

    def connect(
        self, address: tuple[str, int], timeout: float, source_address: tuple[str, int] | None = None
    ) -> socket.socket:
        """http.client's `_create_connection`: connect to the addresses `_check_host` approved (never a
        second DNS answer), each try within what is left of the deadline, and watch the socket."""
        error: OSError = OSError(f"no address to connect to for {address[0]!r}")
        for host in self.addresses:
            remaining = self._end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            try:
                sock = socket.create_connection((host, address[1]), min(timeout, remaining), source_address)
            except OSError as exc:
                error = exc
                continue
            with self._lock:
                if self.expired or self._done:
                    sock.close()
                    raise TimeoutError
                self._watched.append(sock.dup())
            return sock
        raise error


def _connection(scheme: str, host: str, port: int, deadline: _Deadline) -> http.client.HTTPConnection:
    """A direct connection (no proxy, so the address check applies to the host contacted) whose sockets
    come from `deadline`; HTTPS verifies the certificate against `host`."""
    if scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=deadline.seconds, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=deadline.seconds)
    conn._create_connection = deadline.connect  # type: ignore[attr-defined]  # http.client's hook
    return conn


def _is_forbidden_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(addr, ipaddress.IPv6Address):
        mapped = addr.ipv4_mapped or addr.sixtofour
        if mapped is not None and _is_forbidden_address(mapped):
            return True
    return (
        addr.is_private
        or addr.is_loopback
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_unspecified
        or not addr.is_global
    )


def _check_host(host: str, port: int, *, param: str) -> list[str]:
    """The addresses `host` resolves to, all globally routable (else refused); the download connects to
    these, so a second DNS answer cannot point it elsewhere."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as e:
        raise InvalidRequestError(
            f"{param}: could not resolve image URL host {host!r} ({e})", param=param
        ) from None
    if not infos:
        raise InvalidRequestError(f"{param}: image URL host {host!r} did not resolve", param=param)
    addresses: list[str] = []
    for info in infos:
        raw = str(info[4][0]).split("%", 1)[0]  # drop an IPv6 zone id
        try:
            addr = ipaddress.ip_address(raw)
        except ValueError:
            raise InvalidRequestError(
                f"{param}: image URL host {host!r} resolved to an unrecognised address {raw!r}", param=param
            ) from None
        if _is_forbidden_address(addr):
            raise InvalidRequestError(
                f"{param}: image URL host {host!r} resolves to {addr}, a private, loopback, link-local, "
                "multicast or reserved address; only public http(s) hosts may be fetched",
                param=param,
            )
        if str(addr) not in addresses:
            addresses.append(str(addr))
    return addresses


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    path: str  # with the query; never the fragment


def _parse_url(url: str, *, param: str) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise InvalidRequestError(f"{param}: malformed image URL ({e})", param=param) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidRequestError(f"{param}: only http and https image URLs are allowed", param=param)
    host = parts.hostname
    if not host:
        raise InvalidRequestError(f"{param}: image URL has no host", param=param)
    if parts.username is not None or parts.password is not None:
        raise InvalidRequestError(
            f"{param}: image URLs with credentials (user:pass@) are not allowed", param=param
        )
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(scheme, host, port or (443 if scheme == "https" else 80), path)


def _fetch_url(url: str, *, param: str, limits: ImageInputLimits) -> bytes:
    """GET `url` from a checked public address; the whole download (connect, TLS, headers, body) must
    finish within `limits.url_timeout_s`."""
    target = _parse_url(url, param=param)
    addresses = _check_host(target.host, target.port, param=param)
    timed_out = InvalidRequestError(
        f"{param}: fetching the image URL timed out: the whole download must finish within "
        f"{limits.url_timeout_s:g} s",
        param=param,
    )
    with _Deadline(limits.url_timeout_s, addresses) as deadline:
        try:
            data = _download(target, deadline, param=param, limits=limits)
        except InvalidRequestError:
            if deadline.expired:
                raise timed_out from None
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            if deadline.expired or isinstance(e, TimeoutError):
                raise timed_out from None
            raise InvalidRequestError(f"{param}: could not fetch the image URL ({e})", param=param) from None
        if deadline.expired:  # the watchdog's shutdown can look like a clean end of the body
            raise timed_out
    return data


def _download(target: _Target, deadline: _Deadline, *, param: str, limits: ImageInputLimits) -> bytes:
    """The body of a 2xx answer, at most `limits.max_bytes`; redirects and errors are refused."""
    conn = _connection(target.scheme, target.host, target.port, deadline)
    try:
        conn.request("GET", target.path, headers={"User-Agent": "diffserve", "Accept": "image/*"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise InvalidRequestError(
                f"{param}: image URL answered with a redirect ({resp.status} to "
                f"{resp.getheader('Location', '?')}); redirects are not followed - pass the final URL",
                param=param,
            )
        if not 200 <= resp.status < 300:
            raise InvalidRequestError(
                f"{param}: fetching the image URL failed with HTTP {resp.status} {resp.reason}", param=param
            )
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit():
            _check_byte_count(int(length), param=param, limits=limits, what="image at URL")
        chunks: list[bytes] = []
        total = 0
        while total <= limits.max_bytes:
            chunk = resp.read(min(_CHUNK, limits.max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        conn.close()
    _check_byte_count(total, param=param, limits=limits, what="image at URL")
    return b"".join(chunks)


# --------------------------------------------------------------------------------------------- decoding


def _decode(
    data: bytes, *, param: str, limits: ImageInputLimits, keep_alpha: bool, as_mask: bool = False
) -> Image.Image:
    allowed = ", ".join(limits.allowed_formats)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # `formats` restricts which decoders even look at the bytes.
            with Image.open(io.BytesIO(data), formats=list(limits.allowed_formats)) as img:
                width, height = img.size  # from the header; no pixel data decoded yet
                if width * height > limits.max_pixels:
                    raise ImageTooLargeError(
                        f"{param}: image is {width}x{height} ({width * height} pixels), over the limit of "
                        f"{limits.max_pixels} pixels; downscale it first",
                        param=param,
                    )
                if width <= 0 or height <= 0:
                    raise InvalidRequestError(
                        f"{param}: image has an empty size {width}x{height}", param=param
                    )
                if img.format not in limits.allowed_formats:  # defensive; `formats` already restricts
                    raise InvalidRequestError(
                        f"{param}: image format {img.format} is not allowed; allowed formats: {allowed}",
                        param=param,
                    )
                img.seek(0)  # first frame of an animated GIF/WEBP
                img.load()
                img = ImageOps.exif_transpose(img)
                return loaded_mode(img, keep_alpha, as_mask)
    except InvalidRequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageTooLargeError(
            f"{param}: image dimensions are implausibly large (decompression bomb guard); the limit is "
            f"{limits.max_pixels} pixels",
            param=param,
        ) from None
    except UnidentifiedImageError:
        raise InvalidRequestError(
            f"{param}: data is not a recognised image in an allowed format; allowed formats: {allowed}",
            param=param,
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise InvalidRequestError(
            f"{param}: image data is corrupt or truncated and could not be decoded ({e})", param=param
        ) from None


# ------------------------------------------------------------------------------------ several sources

#: What `load_images` takes for one image: anything `load_image` reads, or an already decoded image.
ImageSource = str | Path | bytes | bytearray | memoryview | Image.Image


def without_alpha(images: list[Image.Image]) -> list[Image.Image]:
    """`images` with each RGBA PIL image converted to RGB (its alpha dropped, not composited), the others
    as given: what a family that reads no alpha gets from the loaders' `keep_alpha` input images."""
    return [
        image.convert("RGB") if isinstance(image, Image.Image) and image.mode == "RGBA" else image
        for image in images
    ]


def load_images(
    sources: ImageSource | Sequence[ImageSource],
    *,
    param: str = "image",
    allow_urls: bool = False,
    limits: ImageInputLimits | None = None,
    keep_alpha: bool = False,
    as_mask: bool = False,
) -> list[Image.Image]:
    """One source or a list of them (a tuple or list) as RGB images (`keep_alpha`, `as_mask`: see
    `loaded_mode`), in order.

    PIL images are passed through after `.convert("RGB")` (the caller already decoded them, so no byte
    or pixel bound applies); everything else goes through `load_image`. With several sources an error
    names the one at fault as `param[i]`.
    """
    items = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    if not items:
        raise InvalidRequestError(f"{param}: expected at least one image, got an empty list", param=param)
    out = []
    for i, source in enumerate(items):
        name = param if len(items) == 1 else f"{param}[{i}]"
        if isinstance(source, Image.Image):
            out.append(loaded_mode(source, keep_alpha, as_mask))
        else:
            out.append(
                load_image(
                    source,
                    param=name,
                    allow_urls=allow_urls,
                    limits=limits,
                    keep_alpha=keep_alpha,
                    as_mask=as_mask,
                )
            )
    return out
