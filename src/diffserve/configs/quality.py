"""The per-request `quality` field: which tiers exist, what they promise, and where their settings live.

`lossless` is the exact path. `high`, `medium` and `low` let the DiT reuse its blocks' work between
steps (`models/step_cache.py`), each promising a mean PSNR against lossless (`PSNR_BARS`). A family's
thresholds per tier come from its pipeline class (measured defaults) and, when present, from a
calibration file next to the model's `model_index.json`, written by `diffserve calibrate-cache`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import InvalidRequestError

logger = logging.getLogger("diffserve.quality")

LOSSLESS = "lossless"
#: Exact first, then faster and further from exact.
TIERS = (LOSSLESS, "high", "medium", "low")
APPROXIMATE_TIERS = TIERS[1:]
#: OpenAI's values: "hd" asks for the best image, "standard" for the default.
ALIASES = {"hd": LOSSLESS, "standard": "auto"}
ACCEPTED = ("auto", *TIERS, *ALIASES)
#: Mean PSNR (dB) against lossless that each approximate tier keeps, at least.
PSNR_BARS = {"high": 35.0, "medium": 30.0, "low": 25.0}

CALIBRATION_FILE = "diffserve_step_cache.json"


def check_default_quality(value: str) -> str:
    if value not in TIERS:
        raise ValueError(f"default quality must be one of {', '.join(TIERS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class QualityRule:
    """What a family's requests may ask for: the server default and the approximate tiers it has."""

    default_tier: str = LOSSLESS
    policies: Mapping[str, StepCachePolicy] = field(default_factory=dict)
    family: str = "this model"

    def resolve(self, requested: str | None) -> str:
        """The tier a request runs at; a 400 naming `quality` for anything else."""
        value = "auto" if requested is None else ALIASES.get(requested, requested)
        if value not in ACCEPTED:
            raise InvalidRequestError(
                f"quality must be one of {', '.join(ACCEPTED)}, got {requested!r} ('hd' means lossless, "
                "'standard' and 'auto' the server's default)",
                param="quality",
            )
        tier = self.default_tier if value == "auto" else value
        if tier != LOSSLESS and tier not in self.policies:
            available = ", ".join([LOSSLESS, *self.policies]) if self.policies else LOSSLESS
            raise InvalidRequestError(
                f"quality={requested!r} is not available for {self.family}: it has {available}",
                param="quality",
            )
        return tier


def calibration_path(model_root: str | Path) -> Path:
    return Path(model_root) / CALIBRATION_FILE


def read_calibrated_policies(model_root: str | Path, family: str) -> dict[str, StepCachePolicy]:
    """Tier -> policy from the model folder's calibration file, {} when it has none.

    A file for another family, or one that does not parse, is an error: thresholds from the wrong
    model would silently change what a tier promises.
    """
    path = calibration_path(model_root)
    if not path.is_file():
        return {}
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        if data.get("family") != family:
            raise ValueError(f"it was made for family {data.get('family')!r}, this model is {family!r}")
        policies = {tier: StepCachePolicy(**values) for tier, values in data["tiers"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a valid step-cache calibration ({exc}); delete it or rerun "
            "`diffserve calibrate-cache`"
        ) from exc
    unknown = set(policies) - set(APPROXIMATE_TIERS)
    if unknown:
        raise ValueError(f"{path}: unknown tiers {sorted(unknown)}; tiers are {', '.join(APPROXIMATE_TIERS)}")
    logger.info(
        "Step-cache thresholds from %s: %s",
        path.name,
        {tier: policy.threshold for tier, policy in policies.items()},
    )
    return policies


def write_calibration(
    model_root: str | Path,
    family: str,
    policies: Mapping[str, StepCachePolicy],
    measurements: Mapping[str, Any],
) -> Path:
    """Store calibrated policies next to the model config (atomically: a reader never sees half a file)."""
    path = calibration_path(model_root)
    payload = {
        "family": family,
        "tiers": {tier: policy.to_dict() for tier, policy in policies.items()},
        "measurements": dict(measurements),
    }
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2) + "\n")
    partial.replace(path)
    return path
