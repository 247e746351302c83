"""`--no-webui` leaves the playground's routes out (no browser needed: the app in-process, its engine
never started)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from diffserve.configs.engine_args import EngineArgs
from diffserve.server.app import create_app
from diffserve.server.args import ServerArgs
from diffserve.server.webui_routes import WEBUI_FILES


def test_no_webui_leaves_the_routes_out() -> None:
    def get(webui: bool, path: str) -> int:
        """The status of `path` from an app with or without the web UI (its engine is never started)."""
        app = create_app(ServerArgs(EngineArgs(model_path="/m"), webui=webui))
        return TestClient(app).get(path).status_code

    assert get(True, "/webui/app.js") == 200
    assert get(True, "/webui/webui_routes.py") == 404 and get(True, "/webui/..%2fapp.py") == 404
    assert get(False, "/") == 404 and get(False, "/webui/app.js") == 404


def test_the_page_and_its_files_are_served_by_name_only() -> None:
    client = TestClient(create_app(ServerArgs(EngineArgs(model_path="/m"), api_key="k")))
    for name, kind in WEBUI_FILES.items():
        path = "/" if name == "index.html" else f"/webui/{name}"
        response = client.get(path)  # no key: the page asks for it itself
        assert response.status_code == 200 and response.headers["content-type"] == kind
    # Only the page's own files are open: any other name needs the key like the rest of the server.
    assert client.get("/webui/webui_routes.py").status_code == 401
    assert client.get("/v1/models").status_code == 401  # the API itself still needs the key


def test_the_favicon_is_served_and_the_empty_gallery_line_spans_the_grid() -> None:
    """Issue 31 item 8: no 404 for /favicon.ico on every page load (open, like the page), and the empty
    gallery's one line is not squeezed into one 96-pixel grid column."""
    client = TestClient(create_app(ServerArgs(EngineArgs(model_path="/m"), api_key="k")))
    for path in ("/favicon.ico", "/webui/favicon.svg"):
        response = client.get(path)
        assert response.status_code == 200 and response.headers["content-type"] == "image/svg+xml"
        assert response.content.startswith(b"<svg ")
    page = client.get("/").text
    assert '<link rel="icon" href="/webui/favicon.svg"' in page
    css = client.get("/webui/style.css").text
    assert ".gallery > .hint { grid-column: 1 / -1; }" in css
