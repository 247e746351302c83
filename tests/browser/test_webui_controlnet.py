"""The playground's ControlNet section (issue 35), in headless Chromium against a real `diffserve serve` on
a tiny FLUX folder with a tiny ControlNet loaded (`--controlnet canny=...`): /server_info lists it, the
generate tab shows the section, and an uploaded control image is sent as the `controlnets` field and gives
an image other than the plain one of the same seed. An inpainting ControlNet (the page told so by a rewritten
/server_info) shows a mask input whose file goes as the entry's `mask`, which the server, whose ControlNet is
not one, refuses. Skipped, with the reason printed, when Playwright or a Chromium cannot be found."""

from __future__ import annotations

import base64
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_process import ServerProcess, start_server  # noqa: E402
from webui_chromium import playwright_and_chromium  # noqa: E402

playwright_api, CHROMIUM = playwright_and_chromium()

SIZE = 64
TIMEOUT_MS = 30_000

#: The final image of the viewer as base64 PNG bytes (its blob URL fetched in the page).
FINAL_B64 = """async () => {
  const img = document.querySelector("#results img.final");
  const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
  let text = "";
  for (const b of bytes) text += String.fromCharCode(b);
  return btoa(text);
}"""


@pytest.fixture(scope="module")
def server(tiny_flux_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    from diffserve.families.flux.tiny import TinyFluxSpec
    from diffserve.families.flux.tiny_controlnet import TinyFluxControlNetSpec, build_tiny_flux_controlnet

    work = tmp_path_factory.mktemp("webui-controlnet")
    canny = build_tiny_flux_controlnet(work / "canny", TinyFluxControlNetSpec(TinyFluxSpec(seed=0), seed=1))
    srv = start_server(tiny_flux_dir, work, "--controlnet", f"canny={canny}", "--no-warmup")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def page(server) -> Iterator[object]:
    errors: list[str] = []
    with playwright_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = chromium.new_context(viewport={"width": 1000, "height": 900}, bypass_csp=True)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server.base_url}/")
            page.wait_for_selector("#model-line b")
            yield page
        finally:
            chromium.close()
    assert not errors, errors


def _generate(page) -> np.ndarray:
    """Run the form and return its final image (once the gallery has one more entry)."""
    count = page.eval_on_selector_all("#gallery .gallery-item", "items => items.length")
    page.click("#run")
    page.wait_for_function(f"document.querySelectorAll('#gallery .gallery-item').length > {count}")
    png = base64.b64decode(page.evaluate(FINAL_B64))
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def test_server_info_lists_the_controlnets(server) -> None:
    assert server.info()["engine"]["controlnets"] == [{"name": "canny", "modes": None, "inpainting": False}]


def test_a_control_image_is_sent_and_changes_the_image(page, tmp_path) -> None:
    page.wait_for_selector("#controlnet-box:not([hidden])")
    assert page.eval_on_selector_all("#controlnet-name option", "os => os.map(o => o.value)") == ["", "canny"]
    assert page.is_hidden("#control-mode-label")  # not a Union ControlNet
    assert page.is_hidden("#control-mask-label")  # nor an inpainting one
    page.fill("#prompt", "a red fox")
    page.select_option("#size", "custom")
    page.fill("#width", str(SIZE))
    page.fill("#height", str(SIZE))
    page.fill("#steps", "3")
    page.fill("#seed", "7")
    page.fill("#partial-images", "0")
    plain = _generate(page)

    rng = np.random.default_rng(3)
    control = tmp_path / "edges.png"
    Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(control)
    page.evaluate("document.querySelector('#controlnet-box').open = true")
    page.select_option("#controlnet-name", "canny")
    page.click("#run")
    page.wait_for_selector("#alert:not([hidden])")  # a ControlNet without its image: refused in the page
    assert "control image" in page.inner_text("#alert-text")
    page.click("#alert-close")
    page.set_input_files("#control-file", str(control))
    page.fill("#control-scale", "0.9")
    page.fill("#control-end", "0.8")
    with page.expect_request("**/v1/images/generations") as request:
        controlled = _generate(page)
    body = json.loads(request.value.post_data)
    (entry,) = body["controlnets"]
    assert (entry["name"], entry["scale"], entry["start"], entry["end"]) == ("canny", 0.9, 0, 0.8)
    assert entry["image"].startswith("data:image/png;base64,") and "mode" not in entry
    assert controlled.shape == plain.shape == (SIZE, SIZE, 3)
    assert np.abs(controlled - plain).mean() > 1.0
    # The gallery keeps the parameters, not the control image.
    stored = page.evaluate("JSON.parse(localStorage.getItem('diffserve-gallery'))")
    assert all("controlnets" not in item["params"] for item in stored)


def test_an_inpainting_controlnet_takes_a_mask(page, tmp_path) -> None:
    def as_inpainting(route) -> None:  # /server_info as a server with an inpainting ControlNet answers
        info = route.fetch().json()
        for net in info["engine"]["controlnets"]:
            net["inpainting"] = True
        route.fulfill(json=info)

    page.route("**/server_info", as_inpainting)
    page.reload()
    page.wait_for_selector("#controlnet-box:not([hidden])")
    page.evaluate("document.querySelector('#controlnet-box').open = true")
    page.select_option("#controlnet-name", "canny")
    assert page.is_visible("#control-mask-label")
    control, mask = tmp_path / "edges.png", tmp_path / "mask.png"
    Image.new("RGB", (SIZE, SIZE), "gray").save(control)
    Image.new("L", (SIZE, SIZE), 255).save(mask)
    page.fill("#prompt", "a red fox")
    page.set_input_files("#control-file", str(control))
    page.click("#run")
    page.wait_for_selector("#alert:not([hidden])")  # no mask yet: refused in the page
    assert "mask" in page.inner_text("#alert-text")
    page.click("#alert-close")
    page.set_input_files("#control-mask-file", str(mask))
    with page.expect_response("**/v1/images/generations") as response:
        page.click("#run")
    body = json.loads(response.value.request.post_data)
    assert body["controlnets"][0]["mask"].startswith("data:image/png;base64,")
    assert response.value.status == 400  # the server's ControlNet is not an inpainting one
    page.wait_for_selector("#alert:not([hidden])")
    assert "controlnets[0].mask" in page.inner_text("#alert-text")
