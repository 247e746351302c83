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
dropped, not composited onto a background, so fully transparent pixels keep whatever colour they store.

URL fetching uses `urllib.request` with a timeout, reads at most `max_bytes + 1` bytes, refuses redirects,
connects directly (environment proxies are ignored, so the address check applies to the host actually
contacted) and refuses hosts for which any resolved address is private, loopback, link-local, multicast,
reserved, unspecified or otherwise not globally routable. Known residual risk: DNS rebinding - the name
is resolved once for the check and again by the connection, so a hostile DNS server can answer
differently the second time. Deployments that must rule this out should also block private ranges at
the network level (egress firewall) when enabling `--allow-url-images`.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from diffserve.errors import InvalidRequestError

__all__ = [
    "DEFAULT_ALLOWED_FORMATS",
    "ImageInputLimits",
    "ImageTooLargeError",
    "load_image",
    "load_images",
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
    url_timeout_s: per-socket-operation timeout and overall deadline for a URL download.
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
) -> Image.Image:
    """Load `source` (path, raw bytes, base64 data URL, or - with `allow_urls` - an http(s) URL) as RGB.

    Raises `InvalidRequestError(param=param)` for anything unusable and `ImageTooLargeError` for inputs
    over `limits` (defaults: `ImageInputLimits()`).
    """
    limits = limits if limits is not None else ImageInputLimits()
    data = _read_source(source, param=param, allow_urls=allow_urls, limits=limits)
    return _decode(data, param=param, limits=limits)


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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Do not follow redirects: the 3xx surfaces as an HTTPError, reported as a clear refusal."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def _build_opener() -> urllib.request.OpenerDirector:
    # ProxyHandler({}) ignores *_proxy environment variables so the connection goes to the checked host.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


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


def _check_host(host: str, port: int, *, param: str) -> None:
    """Refuse `host` unless every address it resolves to is globally routable."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as e:
        raise InvalidRequestError(
            f"{param}: could not resolve image URL host {host!r} ({e})", param=param
        ) from None
    if not infos:
        raise InvalidRequestError(f"{param}: image URL host {host!r} did not resolve", param=param)
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


def _fetch_url(url: str, *, param: str, limits: ImageInputLimits) -> bytes:
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
    _check_host(host, port or (443 if scheme == "https" else 80), param=param)

    timeout = limits.url_timeout_s
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "diffserve", "Accept": "image/*"})
    try:
        with _build_opener().open(request, timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.strip().isdigit():
                _check_byte_count(int(length), param=param, limits=limits, what="image at URL")
            chunks: list[bytes] = []
            total = 0
            while total <= limits.max_bytes:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = resp.read(min(_CHUNK, limits.max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
    except urllib.error.HTTPError as e:
        e.close()  # it holds the response and its socket
        if 300 <= e.code < 400:
            target = e.headers.get("Location", "?") if e.headers else "?"
            raise InvalidRequestError(
                f"{param}: image URL answered with a redirect ({e.code} to {target}); redirects are not "
                "followed - pass the final URL",
                param=param,
            ) from None
        raise InvalidRequestError(
            f"{param}: fetching the image URL failed with HTTP {e.code} {e.reason}", param=param
        ) from None
    except TimeoutError:
        raise InvalidRequestError(
            f"{param}: fetching the image URL timed out after {timeout:g} s", param=param
        ) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise InvalidRequestError(
                f"{param}: fetching the image URL timed out after {timeout:g} s", param=param
            ) from None
        raise InvalidRequestError(
            f"{param}: could not fetch the image URL ({e.reason})", param=param
        ) from None
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"{param}: could not fetch the image URL ({e})", param=param) from None
    _check_byte_count(total, param=param, limits=limits, what="image at URL")
    return b"".join(chunks)


# --------------------------------------------------------------------------------------------- decoding


def _decode(data: bytes, *, param: str, limits: ImageInputLimits) -> Image.Image:
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
                return img.convert("RGB")
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


def load_images(
    sources: ImageSource | Sequence[ImageSource],
    *,
    param: str = "image",
    allow_urls: bool = False,
    limits: ImageInputLimits | None = None,
) -> list[Image.Image]:
    """One source or a list of them (a tuple or list) as RGB images, in order.

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
            out.append(source.convert("RGB"))
        else:
            out.append(load_image(source, param=name, allow_urls=allow_urls, limits=limits))
    return out
