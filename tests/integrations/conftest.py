"""The ComfyUI node pack (`integrations/comfyui/`), loaded as ComfyUI loads a custom node folder: a package
named after its folder, imported from its `__init__.py`. The servers it talks to are started with the
server tests' `server_process` helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
PACK_DIR = REPO / "integrations" / "comfyui"
PACK_NAME = "diffserve_comfyui"

# `from server_process import ...` in this folder's tests, as in tests/server/ (a plain module there).
sys.path.insert(0, str(REPO / "tests" / "server"))


def load_pack(name: str = PACK_NAME) -> ModuleType:
    """Import the pack folder as package `name` (ComfyUI uses the folder's name)."""
    spec = importlib.util.spec_from_file_location(
        name, PACK_DIR / "__init__.py", submodule_search_locations=[str(PACK_DIR)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def pack() -> ModuleType:
    return sys.modules.get(PACK_NAME) or load_pack()
