"""The web playground at `/`, driven in headless Chromium (Playwright) against real `diffserve serve`
processes on tiny checkpoints: a FLUX server with --api-key and no waiting room (generate, previews,
gallery, cancel, errors, a painted inpainting mask), a FLUX Kontext server (the edit tab) and a Wan
text-to-video server (the video tab). Skipped, with the reason printed, when Playwright or a Chromium
cannot be found (`make test` installs Debian's chromium when it runs as root)."""

from __future__ import annotations

import base64
import io
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_process import ServerProcess, start_server  # noqa: E402
from webui_chromium import playwright_and_chromium  # noqa: E402

playwright_api, CHROMIUM = playwright_and_chromium()

API_KEY = "webui-key-42"
SIZE = 64  # a multiple of FLUX's and Wan's 16 pixels
TIMEOUT_MS = 30_000


def tiny_checkpoint(family: str, out_dir: Path) -> Path:
    from diffserve.registry import TinyCheckpointOptions, family_by_name

    return family_by_name(family).tiny_builder(out_dir, TinyCheckpointOptions(seed=0))


@pytest.fixture(scope="module")
def servers(tiny_flux_dir, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    """The three servers, started together: each tiny checkpoint is written while the previous server starts."""
    work = tmp_path_factory.mktemp("webui")
    for name in ("flux", "kontext", "wan"):
        (work / name).mkdir()
    # No waiting room and one running slot: a second request while one runs is a 429 at once.
    flags = ("--max-queue-size", "0", "--max-running-requests", "1", "--max-inference-steps", "1000000")
    started = {
        "flux": start_server(tiny_flux_dir, work / "flux", "--api-key", API_KEY, *flags, "--no-warmup")
    }
    started["flux"].api_key = API_KEY
    try:
        kontext = tiny_checkpoint("flux-kontext", work / "kontext-model")
        started["kontext"] = start_server(kontext, work / "kontext", "--no-warmup")
        wan = tiny_checkpoint("wan-t2v", work / "wan-model")
        started["wan"] = start_server(wan, work / "wan", "--no-warmup")
        for srv in started.values():
            srv.wait_ready()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def open_page(browser) -> Iterator[Callable[..., object]]:
    """`open_page(server)`: a fresh browser context (its own storage) on the server's playground, with
    the API key entered when the server asks for one; page errors fail the test."""
    contexts, errors = [], []

    def open_(srv: ServerProcess, key: str | None = None, init_script: str | None = None, wait: bool = True):
        # bypass_csp: Playwright evaluates its wait_for_function strings, which the page's CSP forbids.
        context = browser.new_context(viewport={"width": 1000, "height": 900}, bypass_csp=True)
        contexts.append(context)
        if init_script:
            context.add_init_script(init_script)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{srv.base_url}/")
        if key is not None:
            enter_key(page, key)
        if wait:
            page.wait_for_selector("#model-line b")
        return page

    yield open_
    for context in contexts:
        context.close()
    assert not errors, errors


def enter_key(page, key: str) -> None:
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", key)
    page.click("#key-form button[type=submit]")


def set_size(page, width: int, height: int) -> None:
    page.select_option("#size", "custom")
    page.fill("#width", str(width))
    page.fill("#height", str(height))


def metric(srv: ServerProcess, outcome: str) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    match = re.search(rf'^diffserve_generation_requests_total\{{outcome="{outcome}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def png_bytes(size: int = SIZE) -> bytes:
    rgb = np.zeros((size, size, 3), np.uint8)
    rgb[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = (220, 40, 40)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG")
    return buffer.getvalue()


#: Keeps, as base64, each file part of the multipart bodies the page sends (Playwright does not expose
#: bodies made of Blobs): window.__parts[name].
RECORD_PARTS = """
window.__parts = {};
const originalFetch = window.fetch;
window.fetch = async (url, options = {}) => {
  if (options.body instanceof FormData) {
    for (const [name, value] of options.body.entries()) {
      const bytes = value instanceof Blob ? new Uint8Array(await value.arrayBuffer()) : new TextEncoder().encode(value);
      let text = "";
      for (const b of bytes) text += String.fromCharCode(b);
      window.__parts[name] = btoa(text);
    }
  }
  return originalFetch(url, options);
};
"""

#: Records, in order, each image the viewer shows: "partial" (a streamed preview) or "final".
RECORD_VIEWER = """
window.__shown = [];
new MutationObserver((records) => {
  for (const r of records) for (const node of r.addedNodes)
    if (node.tagName === "IMG") window.__shown.push(node.className);
}).observe(document, {subtree: true, childList: true});
"""


def test_a_wrong_api_key_is_refused_then_the_right_one_is_used(servers, open_page) -> None:
    srv = servers["flux"]
    page = open_page(srv, key="not-the-key", wait=False)
    # The wrong key: the dialog asks again, saying why.
    page.wait_for_function("document.querySelector('#key-reason').textContent.includes('invalid API key')")
    assert page.is_visible("#key-dialog[open]")
    enter_key(page, API_KEY)
    page.wait_for_selector("#tab-generate[aria-selected=true]")
    assert "text-to-image" in page.inner_text("#model-line")
    assert page.evaluate("sessionStorage.getItem('diffserve-api-key')") == API_KEY
    assert page.is_visible("#tab-edit") and not page.is_visible("#tab-video")
    # Size presets are multiples of the model's 16 pixels.
    sizes = [v for v in page.eval_on_selector_all("#size option", "os => os.map(o => o.value)") if "x" in v]
    assert sizes and all(int(side) % 16 == 0 for size in sizes for side in size.split("x")), sizes
    # On a phone: one column (the output under the form), nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    form, output = page.locator("#form").bounding_box(), page.locator(".output").bounding_box()
    assert output["y"] >= form["y"] + form["height"] and output["width"] <= 390


def test_generate_streams_previews_then_the_image_into_the_gallery(servers, open_page) -> None:
    srv = servers["flux"]
    page = open_page(srv, key=API_KEY, init_script=RECORD_VIEWER)
    page.fill("#prompt", "a red fox")
    set_size(page, SIZE, SIZE)
    page.fill("#steps", "12")
    page.fill("#partial-images", "3")
    page.fill("#seed", "7")
    start = time.monotonic()
    page.click("#run")
    page.wait_for_selector("#gallery .gallery-item")
    print(f"generate: the image reached the gallery {time.monotonic() - start:.2f} s after the click")
    shown = page.evaluate("window.__shown")
    assert shown.count("partial") == 3 and shown[-1] == "final", shown
    assert shown.index("final") > shown.index("partial")
    assert page.inner_text("#progress-text").startswith("done in")
    params = json.loads(page.inner_text("#params"))
    assert (params["seed"], params["size"], params["num_inference_steps"]) == (7, f"{SIZE}x{SIZE}", 12)
    download = page.get_attribute("#download", "download")
    assert download.startswith("diffserve-7-") and download.endswith(".png")
    assert page.get_attribute("#download", "href").startswith("blob:")
    final = page.eval_on_selector("#results img.final", "img => [img.naturalWidth, img.naturalHeight]")
    assert final == [SIZE, SIZE]
    # The gallery survives a reload (localStorage), and a click reuses the settings.
    page.reload()
    page.wait_for_selector("#model-line b")
    page.fill("#prompt", "")
    page.click("#gallery .gallery-item")
    assert page.input_value("#prompt") == "a red fox"
    assert (page.input_value("#seed"), page.input_value("#steps")) == ("7", "12")
    page.wait_for_selector("#results img.final")
    entries = page.evaluate("JSON.parse(localStorage.getItem('diffserve-gallery'))")
    assert len(entries) == 1 and entries[0]["thumb"].startswith("data:image/jpeg;base64,")


def test_cancel_stops_the_request_on_the_server(servers, open_page) -> None:
    srv = servers["flux"]
    page = open_page(srv, key=API_KEY)
    cancelled = metric(srv, "cancelled")
    page.fill("#prompt", "a very long request")
    set_size(page, SIZE, SIZE)
    page.fill("#steps", "1000000")
    page.fill("#partial-images", "0")
    page.click("#run")
    assert page.inner_text("#progress-text").startswith("queued")
    srv.wait_for(lambda: srv.info()["engine"]["running"] == 1, what="the request running")
    page.click("#cancel")
    page.wait_for_function("document.querySelector('#progress-text').textContent === 'cancelled'")
    srv.wait_for(lambda: metric(srv, "cancelled") == cancelled + 1, what="the cancelled count")
    srv.wait_for(lambda: re.search(r"cancelled at step \d+", srv.log()), what="the engine cancelling it")
    # The slot is free again: with no waiting room, a request still running would make this one a 429.
    page.fill("#steps", "2")
    start = time.monotonic()
    page.click("#run")
    page.wait_for_selector("#gallery .gallery-item")
    print(f"cancel: the next request finished {time.monotonic() - start:.2f} s after its click")
    assert page.is_hidden("#alert")


def test_server_errors_are_shown(servers, open_page) -> None:
    srv = servers["flux"]
    page = open_page(srv, key=API_KEY)
    page.fill("#prompt", "a red fox")
    set_size(page, SIZE + 1, SIZE)
    page.fill("#steps", "2")
    page.click("#run")
    page.wait_for_selector("#alert:not([hidden])")
    message = page.inner_text("#alert-text")
    assert "65" in message and "16" in message, message
    assert page.inner_text("#progress-text") == "failed"

    # A full queue: one request runs (sent from here), and the server keeps no one waiting.
    body = {"prompt": "busy", "size": f"{SIZE}x{SIZE}", "num_inference_steps": 1000000, "stream": True}
    with httpx.Client(timeout=60) as client:
        stop = threading.Event()

        def hold() -> None:
            with client.stream(
                "POST", f"{srv.base_url}/v1/images/generations", json=body, headers=srv.headers
            ):
                stop.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            srv.wait_for(lambda: srv.info()["engine"]["running"] == 1, what="the request running")
            set_size(page, SIZE, SIZE)
            page.click("#run")
            page.wait_for_function(
                "document.querySelector('#alert-text').textContent.includes('queue is full')"
            )
            assert page.is_visible("#alert")
        finally:
            stop.set()
            holder.join(30)
    srv.wait_for(lambda: srv.info()["engine"]["running"] == 0, what="the held request cancelled")


def test_edit_with_a_painted_mask_sends_openais_transparent_mask(servers, open_page, tmp_path) -> None:
    srv = servers["flux"]  # FLUX.1 inpaints from an input image and a mask
    page = open_page(srv, key=API_KEY, init_script=RECORD_PARTS)
    page.click("#tab-edit")
    image = tmp_path / "input.png"
    image.write_bytes(png_bytes())
    page.set_input_files("#edit-file", str(image))
    page.wait_for_selector("#mask-tools:not([hidden])")
    box = page.locator("#mask-canvas").bounding_box()
    # Paint a stroke across the middle of the image.
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.5)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.5, steps=5)
    page.mouse.up()
    page.fill("#prompt", "a blue square")
    page.fill("#steps", "4")
    page.fill("#strength", "0.9")
    page.click("#run")
    page.wait_for_selector("#gallery .gallery-item")
    parts = {name: base64.b64decode(data) for name, data in page.evaluate("window.__parts").items()}
    with Image.open(io.BytesIO(parts["mask"])) as mask:
        alpha = np.asarray(mask.convert("RGBA"))[..., 3]
    assert alpha.shape == (SIZE, SIZE)
    assert alpha[SIZE // 2, SIZE // 2] == 0 and alpha[2, 2] == 255  # painted: transparent; the rest opaque
    assert parts["image"] == image.read_bytes()
    assert (parts["strength"], parts["stream"], parts["prompt"]) == (b"0.9", b"true", b"a blue square")
    assert page.is_hidden("#alert")
    entries = page.evaluate("JSON.parse(localStorage.getItem('diffserve-gallery'))")
    assert entries[0]["tab"] == "edit" and entries[0]["size"] == f"{SIZE}x{SIZE}"


def test_edit_tab_round_trip_on_an_edit_model(servers, open_page, tmp_path) -> None:
    srv = servers["kontext"]
    page = open_page(srv)  # no --api-key: no dialog
    # An edit model needs an input image: only the edit tab.
    page.wait_for_selector("#tab-edit[aria-selected=true]")
    assert page.is_hidden("#tab-generate") and page.input_value("#size") == "auto"
    assert page.is_hidden("#mask-tools")  # Kontext edits the whole image: /server_info says it cannot inpaint
    page.fill("#prompt", "make it blue")
    page.fill("#steps", "2")
    page.click("#run")
    page.wait_for_selector("#alert:not([hidden])")
    assert "input image" in page.inner_text("#alert-text")  # checked before sending
    image = tmp_path / "input.png"
    image.write_bytes(png_bytes(48))
    page.set_input_files("#edit-file", str(image))
    set_size(page, SIZE, SIZE)  # "auto" would be Kontext's ~1024x1024 preferred resolution: slow here
    page.click("#run")
    page.wait_for_selector("#gallery .gallery-item")
    size = page.eval_on_selector("#results img.final", "img => [img.naturalWidth, img.naturalHeight]")
    assert size == [SIZE, SIZE]
    thumb = page.evaluate("JSON.parse(localStorage.getItem('diffserve-gallery'))[0].thumb")
    with Image.open(io.BytesIO(base64.b64decode(thumb.split(",", 1)[1]))) as decoded:
        assert decoded.size == tuple(size)


def test_a_video_job_appears_with_a_player(servers, open_page) -> None:
    srv = servers["wan"]
    page = open_page(srv)
    page.wait_for_selector("#tab-video[aria-selected=true]")
    assert page.is_hidden("#tab-generate") and page.is_hidden("#tab-edit")
    page.fill("#prompt", "waves")
    set_size(page, 32, 32)
    page.fill("#num-frames", "5")
    page.fill("#fps", "8")
    page.fill("#steps", "2")
    start = time.monotonic()
    page.click("#run")
    page.wait_for_selector(".job[data-status=completed] video")
    print(f"video: the player appeared {time.monotonic() - start:.2f} s after the click")
    # The MP4 was fetched with the page's credentials and the player reads it.
    page.wait_for_function("document.querySelector('.job video').readyState >= 1")
    duration = page.eval_on_selector(".job video", "v => v.duration")
    assert duration == pytest.approx(5 / 8, abs=0.2)
    assert page.get_attribute(".job a[download]", "download").endswith(".mp4")
    assert page.is_hidden("#alert")


def test_a_streamed_video_plays_its_chunks_as_they_arrive(servers, open_page) -> None:
    """The video tab creates jobs with "stream": true and appends their fragmented-MP4 segments to a
    MediaSource as the server-sent events bring them (issue 36)."""
    srv = servers["wan"]
    page = open_page(srv)
    page.wait_for_selector("#tab-video[aria-selected=true]")
    page.fill("#prompt", "live waves")
    set_size(page, 32, 32)
    page.fill("#num-frames", "9")  # chunks of 1, 4 and 4 frames
    page.fill("#fps", "8")
    page.fill("#steps", "2")
    page.click("#run")
    page.wait_for_selector("#live-player")
    unsupported = page.get_attribute("#live-player", "data-unsupported")
    if unsupported:
        pytest.skip(f"this Chromium's MediaSource cannot play {unsupported}")
    page.wait_for_function("document.querySelector('#live-player').dataset.chunks === '3'")
    # Every segment was appended and the stream ended: the player holds the whole clip.
    page.wait_for_function("document.querySelector('#live-player').readyState >= 1")
    page.wait_for_function(
        "(v => v.buffered.length === 1 && Math.abs(v.buffered.end(0) - 9 / 8) < 0.2)"
        "(document.querySelector('#live-player'))"
    )
    assert page.is_hidden("#alert")


def test_static_files_content_types_and_no_traversal(servers) -> None:
    srv = servers["flux"]
    expected = {"/": "text/html", "/webui/app.js": "text/javascript", "/webui/style.css": "text/css"}
    for path, kind in expected.items():
        response = httpx.get(f"{srv.base_url}{path}", timeout=10)  # open: the page asks for the key
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        assert response.headers["x-content-type-options"] == "nosniff"
    for path in ("/webui/..%2fapp.py", "/webui/%2e%2e%2fargs.py", "/webui/../webui_routes.py", "/webui/x.js"):
        response = httpx.get(f"{srv.base_url}{path}", timeout=10)
        assert response.status_code in (401, 404), (path, response.status_code)
        assert b"import" not in response.content
    # The page loads nothing from elsewhere: no http(s) URL in any of its files.
    for path in expected:
        text = httpx.get(f"{srv.base_url}{path}", timeout=10).text
        assert not re.search(r"(src|href)=\"https?:|url\(https?:|@import", text), path
