"""diffserve: a fast serving engine for diffusion models.

`DiffGenerator`, `GenerationOutput` and `SamplingParams` are imported on first use, so importing a
leaf module (platforms, layers) does not load the whole engine and its model code.
"""

from __future__ import annotations

import importlib
from typing import Any

# First, before anything imports torch: OpenMP reads its wait policy once, when torch loads it.
from diffserve import openmp_env  # noqa: F401

__version__ = "0.1.0"
__all__ = ["DiffGenerator", "GenerationOutput", "SamplingParams", "__version__"]

_LAZY = {
    "DiffGenerator": "diffserve.api",
    "GenerationOutput": "diffserve.api",
    "SamplingParams": "diffserve.configs.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diffserve' has no attribute {name!r}")
