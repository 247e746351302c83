"""Optional per-folder sampling defaults: `diffserve.json` next to `model_index.json`.

A model trained for one resolution or step count (such as the shipped demo model) says so here,
so users get sensible defaults without flags. Diffusers ignores the file. Format:

    {"sampling_defaults": {"height": 64, "width": 64, "num_inference_steps": 20}}
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import ModelLoadError

FILE_NAME = "diffserve.json"
_NOT_DEFAULTABLE = {"prompt", "seed", "extra"}


def read_folder_sampling_defaults(model_root: Path) -> dict[str, Any]:
    """The folder's sampling defaults (empty when it has no diffserve.json); unknown keys are an error."""
    path = model_root / FILE_NAME
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    defaults = raw.get("sampling_defaults", {})
    allowed = {f.name for f in fields(SamplingParams)} - _NOT_DEFAULTABLE
    unknown = sorted(set(defaults) - allowed)
    if unknown:
        raise ModelLoadError(f"{path}: unknown sampling_defaults keys {unknown}; allowed: {sorted(allowed)}")
    return {k: v for k, v in defaults.items() if v is not None}


def apply_overrides(defaults: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
    """A copy of the family `defaults` with the folder's `overrides` applied."""
    values = {f.name: getattr(defaults, f.name) for f in fields(SamplingParams)}
    values.update(overrides)
    return SamplingParams(**values)
