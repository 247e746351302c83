"""Optional per-folder sampling defaults: `diffserve.json` next to `model_index.json`.

A model trained for one resolution or step count (such as the shipped demo model) says so here, so users
get sensible defaults without flags. Diffusers ignores the file. Format:

    {"sampling_defaults": {"height": 64, "width": 64, "num_inference_steps": 20}}
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import ModelLoadError
from diffserve.loader.model_index import read_json

_NOT_DEFAULTABLE = {"prompt", "seed", "extra"}


def read_folder_sampling_defaults(model_root: Path) -> dict[str, Any]:
    """The folder's sampling defaults (empty when it has no diffserve.json); unknown keys are an error."""
    path = model_root / "diffserve.json"
    if not path.is_file():
        return {}
    defaults = read_json(path).get("sampling_defaults", {})
    allowed = {f.name for f in fields(SamplingParams)} - _NOT_DEFAULTABLE
    unknown = sorted(set(defaults) - allowed)
    if unknown:
        raise ModelLoadError(f"{path}: unknown sampling_defaults keys {unknown}; allowed: {sorted(allowed)}")
    return {k: v for k, v in defaults.items() if v is not None}


def apply_overrides(defaults: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
    """A copy of the family `defaults` with the folder's `overrides` applied."""
    return replace(defaults, **overrides)
