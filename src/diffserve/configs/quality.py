"""The per-request `quality` field: which tiers exist, what they promise, and what each one runs.

The names follow OpenAI's meaning, where `high` is the best image: `high` is the exact path (also
accepted as `hd` and `lossless`). `medium`, `low` and diffserve's own `draft` let the DiT reuse its
blocks' work between steps, each promising a mean PSNR against the exact output (`PSNR_BARS`). `auto` and
OpenAI's `standard` mean the server's `--default-quality`. Every response, file and log reports the
canonical tier (`high`, never `lossless`).

An approximate tier is a preset (`TierPreset`): a cache method by name with its settings (DBCache,
TeaCache, ...: `configs/cache_settings.py`), or diffserve's original step cache (`StepCachePolicy`). A
family's presets per tier come from its pipeline class (measured defaults) and, when present, from a
calibration file next to the model's `model_index.json`, written by `diffserve calibrate-cache`, which
picks per tier the method and settings that compute the fewest DiT blocks while meeting the tier's bar.
The response's `cache` report names the method and settings a tier request ran.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffserve.configs.cache_settings import CacheSettings, NoCache, parse_cache
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import InvalidRequestError

logger = logging.getLogger("diffserve.quality")

#: The exact path: no step reuses cached work.
EXACT = "high"
AUTO = "auto"
#: Exact first, then faster and further from exact.
TIERS = (EXACT, "medium", "low", "draft")
APPROXIMATE_TIERS = TIERS[1:]
#: Other accepted names -> what they mean: OpenAI's "hd" (its best image) and diffserve's former name
#: of the exact tier; OpenAI's "standard" is its default.
ALIASES = {"hd": EXACT, "lossless": EXACT, "standard": AUTO}
ACCEPTED = (AUTO, *TIERS, *ALIASES)
#: What `--default-quality` accepts: a tier, or a name of the exact one.
DEFAULT_QUALITY_CHOICES = (*TIERS, *(name for name, tier in ALIASES.items() if tier == EXACT))
#: Mean PSNR (dB) against the exact output that each approximate tier keeps, at least.
PSNR_BARS = {"medium": 35.0, "low": 30.0, "draft": 25.0}

#: What an approximate tier runs: a cache method with its settings, or the original step cache.
TierPreset = CacheSettings | StepCachePolicy

CALIBRATION_FILE = "diffserve_step_cache.json"
#: Written into every calibration file: 3 records a preset per tier ({"method": ..., settings}); 2 (still
#: read) a step-cache policy per tier; a file without a format predates the OpenAI-aligned names.
CALIBRATION_FORMAT = 3
_STEP_CACHE_FORMAT = 2
#: Tier names in calibration files without a format (before version 2) -> today's names (same bars).
_FORMAT_1_TIERS = {"high": "medium", "medium": "low", "low": "draft"}


def canonical_tier(value: str) -> str:
    """The tier `value` names (`lossless` and `hd` -> `high`), or `auto`; ValueError for anything else."""
    name = ALIASES.get(value, value)
    if name not in (AUTO, *TIERS):
        raise ValueError(f"unknown quality {value!r}; one of {', '.join(ACCEPTED)}")
    return name


def check_default_quality(value: str) -> str:
    """The canonical tier of a `--default-quality` value (`lossless` -> `high`); ValueError otherwise."""
    if value not in DEFAULT_QUALITY_CHOICES:
        raise ValueError(
            f"default quality must be one of {', '.join(DEFAULT_QUALITY_CHOICES)}, got {value!r}"
        )
    return canonical_tier(value)


@dataclass(frozen=True)
class QualityRule:
    """What a family's requests may ask for: the server default and the approximate tiers it has, each
    with its preset.

    `default_tier` may be given under any name `--default-quality` accepts; it is stored canonical so that
    an `auto` request reports `high`, never `lossless`.
    """

    default_tier: str = EXACT
    #: Approximate tier -> the preset it runs (what the family and the model folder's calibration give).
    policies: Mapping[str, TierPreset] = field(default_factory=dict)
    family: str = "this model"

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_tier", check_default_quality(self.default_tier))
        unknown = set(self.policies) - set(APPROXIMATE_TIERS)
        if unknown:
            raise ValueError(
                f"{self.family}: unknown step-cache tiers {sorted(unknown)}; tiers are "
                f"{', '.join(APPROXIMATE_TIERS)}"
            )

    def resolve(self, requested: str | None) -> str:
        """The canonical tier a request runs at; a 400 naming `quality` for anything else."""
        try:
            value = AUTO if requested is None else canonical_tier(requested)
        except ValueError:
            raise InvalidRequestError(
                f"quality must be one of {', '.join(ACCEPTED)}, got {requested!r} ('hd' and 'lossless' mean "
                "high, the exact output; 'standard' and 'auto' the server's default)",
                param="quality",
            ) from None
        tier = self.default_tier if value == AUTO else value
        if tier != EXACT and tier not in self.policies:
            available = ", ".join([EXACT, *self.policies])
            raise InvalidRequestError(
                f"quality={requested!r} is not available for {self.family}: it has {available}",
                param="quality",
            )
        return tier


def calibration_path(model_root: str | Path) -> Path:
    return Path(model_root) / CALIBRATION_FILE


def preset_to_dict(preset: TierPreset) -> dict[str, Any]:
    """{"method": name, setting: value, ...}: how calibration files, logs and reports spell a preset."""
    if isinstance(preset, StepCachePolicy):
        return {"method": StepCachePolicy.method, **preset.to_dict()}
    return preset.to_dict()


def preset_from_dict(values: Mapping[str, Any]) -> TierPreset:
    """A preset from its `preset_to_dict` form: "stepcache" is the original step cache, any other method a
    cache method's settings, checked as a request's `cache` is (ValueError naming what is wrong)."""
    method = values.get("method")
    if method == StepCachePolicy.method:
        return StepCachePolicy(**{k: v for k, v in values.items() if k != "method"})
    try:
        settings = parse_cache(dict(values))
    except InvalidRequestError as exc:
        raise ValueError(str(exc)) from None
    if settings is None or isinstance(settings, NoCache):
        raise ValueError(f"a tier's preset must reuse work; got method {method!r}")
    return settings


def describe_preset(preset: TierPreset) -> str:
    """A one-line name for logs and tables: the method and the settings that differ from its defaults
    ("dbcache(Fn_compute_blocks=1, residual_diff_threshold=0.12)")."""
    default = type(preset)() if not isinstance(preset, StepCachePolicy) else None
    values = preset_to_dict(preset)
    defaults = {} if default is None else preset_to_dict(default)
    shown = [
        f"{k}={_short(v)}"
        for k, v in values.items()
        if k != "method" and (defaults.get(k, object()) != v or (k == "steps_computation_mask" and v))
    ]
    return f"{values['method']}({', '.join(shown)})"


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6:
        return f"[{len(value)} values]"
    if isinstance(value, list):
        return "".join(map(str, value)) if set(value) <= {0, 1} else str(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def read_calibrated_policies(model_root: str | Path, family: str) -> dict[str, TierPreset]:
    """Tier -> preset from the model folder's calibration file, {} when it has none.

    A file for another family, of an unknown format, or one that does not parse, is an error: presets
    from the wrong model would silently change what a tier promises. Format 3 records a preset per tier;
    format 2 a step-cache policy (threshold, ...) per tier, which still runs as one (`StepCachePolicy`). A
    file without a format predates the OpenAI-aligned names; it is read with a warning, its tiers renamed
    (`_FORMAT_1_TIERS`).
    """
    path = calibration_path(model_root)
    if not path.is_file():
        return {}
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        if data.get("family") != family:
            raise ValueError(f"it was made for family {data.get('family')!r}, this model is {family!r}")
        tiers = _current_tier_names(path, data)
        if data.get("format") == CALIBRATION_FORMAT:
            policies = {tier: preset_from_dict(values) for tier, values in tiers.items()}
        else:
            policies = {tier: StepCachePolicy(**values) for tier, values in tiers.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path} is not a valid step-cache calibration ({exc}); delete it or rerun "
            "`diffserve calibrate-cache`"
        ) from exc
    unknown = set(policies) - set(APPROXIMATE_TIERS)
    if unknown:
        raise ValueError(f"{path}: unknown tiers {sorted(unknown)}; tiers are {', '.join(APPROXIMATE_TIERS)}")
    logger.info(
        "Quality-tier presets from %s: %s",
        path.name,
        {tier: describe_preset(preset) for tier, preset in policies.items()},
    )
    return policies


def _current_tier_names(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The file's `tiers` under today's names (a format-1 file's are renamed, with a warning)."""
    version = data.get("format")
    tiers: dict[str, Any] = data["tiers"]
    if version in (CALIBRATION_FORMAT, _STEP_CACHE_FORMAT):
        return tiers
    if version is not None:
        raise ValueError(
            f"unknown format {version!r}; this diffserve reads format {_STEP_CACHE_FORMAT} (step-cache "
            f"thresholds) and {CALIBRATION_FORMAT} (cache-method presets)"
        )
    unknown = set(tiers) - set(_FORMAT_1_TIERS)
    if unknown:
        raise ValueError(f"unknown tiers {sorted(unknown)} in a file without a format")
    renamed = {_FORMAT_1_TIERS[tier]: values for tier, values in tiers.items()}
    logger.warning(
        "%s uses the old tier names (before OpenAI's meaning): read as %s; rerun `diffserve calibrate-cache` "
        "to rewrite it",
        path,
        ", ".join(f"{old} -> {_FORMAT_1_TIERS[old]}" for old in tiers),
    )
    return renamed


def write_calibration(
    model_root: str | Path,
    family: str,
    policies: Mapping[str, TierPreset],
    measurements: Mapping[str, Any],
) -> Path:
    """Store calibrated presets (format 3) next to the model config (atomically: a reader never sees half
    a file)."""
    path = calibration_path(model_root)
    payload = {
        "format": CALIBRATION_FORMAT,
        "family": family,
        "tiers": {tier: preset_to_dict(preset) for tier, preset in policies.items()},
        "measurements": dict(measurements),
    }
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2) + "\n")
    partial.replace(path)
    return path
