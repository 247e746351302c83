"""Shared fixtures: tiny FLUX checkpoints built once per test session (random weights, Diffusers layout);
and the collection order that starts the longest test files first."""

from __future__ import annotations

import pytest

#: The test files that take minutes (each document's examples, servers, compiles), longest first. `make
#: test` hands whole files to its two workers in collection order (`--dist loadfile`): started last, one
#: of them kept a worker busy for minutes after the other had finished.
LONG_FILES = (
    "tests/e2e/test_docs_examples.py",
    "tests/e2e/test_docs_pages.py",
    "tests/unit/test_compile.py",
    "tests/server/test_videos.py",
    "tests/browser/test_webui.py",
    "tests/server/test_multi_rank_server.py",
    "tests/e2e/test_demo_model.py",
    "tests/integrations/test_comfyui_nodes.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the items of `LONG_FILES` to the front, in that order; the rest keep theirs."""
    rank = {path: i for i, path in enumerate(LONG_FILES)}

    def key(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(LONG_FILES))

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
