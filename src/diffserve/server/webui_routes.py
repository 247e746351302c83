"""The web playground: `/` and its static files (`webui/`: plain HTML, CSS and JS, no build step, no
CDN; its icon, also at `/favicon.ico` where browsers ask for it), for trying the served model from a browser. The page talks to the public routes only, as any
client does, so it adds no capability; `--no-webui` leaves these routes out.

The files are served by name from a fixed table, never from a path taken from the URL, so no request can
reach another file. They need no API key (middleware.OPEN_PATHS): the page asks for the key on a 401 and
sends it as `Authorization: Bearer`, as every client must.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from diffserve.server.errors import ApiError

#: The page's files and their content types; nothing else is served.
WEBUI_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
#: The page loads nothing from elsewhere (it works offline) and runs no inline script; images and videos
#: are data: or blob: URLs made from the API's answers.
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
}


def webui_file(name: str) -> Response:
    """One of WEBUI_FILES, read from the installed package (404 for any other name)."""
    media_type = WEBUI_FILES.get(name)
    if media_type is None:
        raise ApiError(404, f"no web UI file named {name!r}", code="not_found")
    data = (resources.files("diffserve.server") / "webui" / name).read_bytes()
    return Response(data, media_type=media_type, headers=_HEADERS)


#: `GET /` (the page) and `GET /webui/{name}` (its script and style sheet); not in the OpenAPI schema.
router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> Response:
    return webui_file("index.html")


@router.get("/favicon.ico")
async def favicon() -> Response:
    """Browsers ask every site for it: the page's SVG icon (what they accept under this name too)."""
    return webui_file("favicon.svg")


@router.get("/webui/{name}")
async def static_file(name: str) -> Response:
    return webui_file(name)
