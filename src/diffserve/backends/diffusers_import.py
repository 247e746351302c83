"""Import diffusers for `--backend diffusers` only: it is the optional extra `diffserve[diffusers]`."""

from __future__ import annotations

import importlib
from types import ModuleType

from diffserve.errors import UserError

INSTALL_HINT = "pip install 'diffserve[diffusers]'"


def import_diffusers() -> ModuleType:
    """The `diffusers` module, or a UserError saying how to install it."""
    try:
        return importlib.import_module("diffusers")
    except ImportError as exc:
        raise UserError(
            f"--backend diffusers needs the diffusers package, which is not installed ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
