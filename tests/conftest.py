"""Shared fixtures: tiny FLUX checkpoints built once per test session (random weights, Diffusers layout);
the order that hands the longest test files to `make test`'s two workers first; byte-code caching for the
suite's many Python processes."""

from __future__ import annotations

import os
import sys

import pytest

# Byte code is cached (`__pycache__/`, git-ignored) even where the environment asks Python not to write it
# (PYTHONDONTWRITEBYTECODE): the suite starts hundreds of Python processes (servers and their engines, CLI
# runs, rank processes), and each one compiled diffserve's sources again, a second of CPU apiece. Set here,
# before the test modules are imported, so the workers' imports and every subprocess's inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

#: Seconds each long test file took in `make test` on a 2-core machine (both workers busy), longest first.
#: `make test` (`--dist loadfile`) hands whole files to its two workers in collection order: these first,
#: longest first, then the others, so that the last files to start are short ones and both workers finish
#: together. A file missing here runs after them; a new long one belongs in the table.
FILE_SECONDS = {
    "tests/e2e/test_docs_examples.py": 250,
    "tests/unit/test_compile.py": 185,
    "tests/server/test_videos.py": 120,
    "tests/browser/test_webui.py": 120,
    "tests/server/test_multi_rank_server.py": 100,
    "tests/e2e/test_demo_model.py": 100,
    "tests/integrations/test_comfyui_nodes.py": 100,
}


def pytest_configure(config: pytest.Config) -> None:
    # xdist sorts files by their number of tests before handing them out (`--loadscope-reorder`, its
    # default), which put the few-test long files (documents, compiles) last: keep the order below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The items of `FILE_SECONDS`' files first, longest file first; the rest keep their order."""

    def key(item: pytest.Item) -> float:
        return -FILE_SECONDS.get(item.nodeid.split("::", 1)[0], 0)

    items.sort(key=key)  # stable: order within a file and among the other files is kept


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory):
    """FLUX.1-dev style: guidance embedding on."""
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux"), TinyFluxSpec(seed=0, guidance_embeds=True))


@pytest.fixture(scope="session")
def tiny_flux_schnell_dir(tmp_path_factory: pytest.TempPathFactory):
    """FLUX.1-schnell style: no guidance embedding."""
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(
        tmp_path_factory.mktemp("tiny-flux-schnell"), TinyFluxSpec(seed=1, guidance_embeds=False)
    )
