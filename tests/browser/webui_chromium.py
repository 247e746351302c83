"""What the playground's browser test files need before anything else: Playwright's sync API and a Chromium
on PATH. `playwright_and_chromium()`, called at a test module's import, skips the whole module, with the
reason printed, when either is missing (`make test` installs Debian's chromium when it runs as root)."""

from __future__ import annotations

import shutil
from types import ModuleType

import pytest


def playwright_and_chromium() -> tuple[ModuleType, str]:
    """`playwright.sync_api` and the path of the first Chromium found on PATH; skips the calling module
    when Playwright is not installed or no Chromium is found."""
    playwright_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright for Python is not installed (pip install -e '.[test]')"
    )
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if chromium is None:
        pytest.skip(
            "no Chromium found on PATH (apt-get install chromium; `make test` does it as root)",
            allow_module_level=True,
        )
    return playwright_api, chromium
