"""Screenshots of the web playground's three tabs, for the docs, from real servers and real generations.

    .venv/bin/python tools/webui_screenshots.py      # writes docs/images/webui-{generate,edit,video}.png

Generate and edit run on the shipped demo model (`diffserve serve` without --model-path); the video tab on
a tiny random Wan checkpoint (`diffserve make-tiny wan-t2v`), so its frames are noise. Needs Playwright
for Python and a Chromium on PATH (Debian: apt-get install chromium).
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image
from playwright.sync_api import Page, sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from server_process import ServerProcess, start_server  # noqa: E402

from diffserve.configs.demo_model import demo_model_path  # noqa: E402

PROMPTS = [
    "a large red circle in the center on a black background",
    "a small green square at the top left on a white background",
    "a large blue triangle at the bottom right on a gray background",
    "a small yellow circle at the top right on a black background",
]
WIDTH = 1000


def save(page: Page, path: Path) -> None:
    """A full-page PNG of the page, WIDTH px wide, quantised to stay small."""
    shot = Image.open(io.BytesIO(page.screenshot(full_page=True)))
    shot.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    print(f"{path}: {shot.width}x{shot.height}, {path.stat().st_size // 1024} KiB")


def generate_and_edit(page: Page, srv: ServerProcess, out_dir: Path) -> None:
    page.goto(f"{srv.base_url}/")
    page.wait_for_selector("#model-line b")
    for seed, prompt in enumerate(PROMPTS):
        page.fill("#prompt", prompt)
        page.fill("#seed", str(seed))
        page.click("#run")
        page.wait_for_function(f"document.querySelectorAll('#gallery .gallery-item').length === {seed + 1}")
    save(page, out_dir / "webui-generate.png")
    page.click("#use-as-input")  # the last image, into the edit tab
    page.wait_for_selector("#mask-tools:not([hidden])")
    box = page.locator("#mask-canvas").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.55, box["y"] + box["height"] * 0.2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.8, box["y"] + box["height"] * 0.35, steps=8)
    page.mouse.up()
    page.fill("#prompt", "a small blue circle at the top right on a black background")
    page.click("#run")
    page.wait_for_function("document.querySelectorAll('#gallery .gallery-item').length === 5")
    save(page, out_dir / "webui-edit.png")


def video(page: Page, srv: ServerProcess, out_dir: Path) -> None:
    page.goto(f"{srv.base_url}/")
    page.wait_for_selector("#tab-video[aria-selected=true]")
    page.fill("#prompt", "ocean waves at sunset")
    page.select_option("#size", "custom")
    page.fill("#width", "64")
    page.fill("#height", "48")
    page.fill("#num-frames", "9")
    page.fill("#fps", "8")
    page.fill("#steps", "4")
    for _ in range(2):
        page.click("#run")
        page.wait_for_function("!document.querySelector('#run').disabled")
    page.wait_for_function(
        "[...document.querySelectorAll('.job[data-status=completed] video')].filter(v => v.readyState >= 2)"
        ".length === 2"
    )
    save(page, out_dir / "webui-video.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wan = work / "wan-model"
        subprocess.run(
            [sys.executable, "-m", "diffserve.cli.main", "make-tiny", "wan-t2v", str(wan)], check=True
        )
        (work / "demo").mkdir()
        (work / "wan").mkdir()
        servers = [
            start_server(demo_model_path(), work / "demo"),
            start_server(wan, work / "wan", "--no-warmup"),
        ]
        try:
            for srv in servers:
                srv.wait_ready()
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, headless=True)
                # bypass_csp: Playwright evaluates its wait_for_function strings, which the page's CSP forbids.
                page = browser.new_page(
                    viewport={"width": WIDTH, "height": 800}, color_scheme="light", bypass_csp=True
                )
                generate_and_edit(page, servers[0], args.out_dir)
                video(page, servers[1], args.out_dir)
                browser.close()
        finally:
            for srv in servers:
                srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
