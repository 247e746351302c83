"""The PEFT `LoraConfig` Diffusers stores in a LoRA file's safetensors metadata, and the alpha it gives
each module.

Diffusers' `save_lora_weights` writes `lora_adapter_metadata`: one JSON object whose keys are the
component's name and a `LoraConfig` field (`transformer.r`, `transformer.lora_alpha`,
`transformer.rank_pattern`, ...). When loading, Diffusers passes each component's fields, prefix
removed, straight to `LoraConfig(**fields)` instead of inferring the config from the weights (a field
left out takes `LoraConfig`'s default: r = 8, lora_alpha = 8).
PEFT then gives each module the rank and alpha of the first `rank_pattern` / `alpha_pattern` key that
matches the end of the module's name (`re.match(rf"(.*\\.)?({key})$", name)`), else `r` /
`lora_alpha`, and scales by `alpha / r`, or `alpha / sqrt(r)` with `use_rslora`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from diffserve.loader.lora_formats.pairs import lora_error

METADATA_KEY = "lora_adapter_metadata"
_PEFT_DEFAULT_R = 8
_PEFT_DEFAULT_ALPHA = 8


@dataclass(frozen=True)
class AdapterConfig:
    """The `LoraConfig` fields that decide a module's scaling."""

    r: int = _PEFT_DEFAULT_R
    lora_alpha: float = _PEFT_DEFAULT_ALPHA
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False

    def module_alpha(self, module: str, rank: int, label: str, source: str) -> float:
        """The alpha to store for `module` (rank `rank` in the file) so that `alpha / rank` is the
        scaling PEFT applies. PEFT builds the layer with the configured rank, so a file whose weights
        have another rank does not load: that is an error here too."""
        configured = _pattern_value(self.rank_pattern, module, self.r, source)
        if int(configured) != rank:
            raise lora_error(
                source,
                f"{label} has rank {rank} but the file's {METADATA_KEY} configures rank {configured} for it",
            )
        alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha, source))
        return alpha * math.sqrt(rank) if self.use_rslora else alpha


def _pattern_value(
    patterns: dict[str, int] | dict[str, float], module: str, default: float, source: str
) -> float:
    for key, value in patterns.items():
        try:
            matched = re.match(rf"(.*\.)?({key})$", module)
        except re.error as exc:
            raise lora_error(source, f"{METADATA_KEY} has an invalid pattern {key!r}: {exc}") from exc
        if matched:
            return value
    return default


def read_adapter_metadata(file_metadata: dict[str, str], source: str) -> dict[str, AdapterConfig] | None:
    """Each component's config from the file's `lora_adapter_metadata`; None when the file has none
    (Diffusers then infers alpha = rank)."""
    raw = file_metadata.get(METADATA_KEY)
    if not raw:
        return None
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise lora_error(source, f"{METADATA_KEY} is not valid JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise lora_error(source, f"{METADATA_KEY} must be a JSON object, got {type(fields).__name__}")
    by_component: dict[str, dict[str, object]] = {}
    for name, value in fields.items():
        component, _, field_name = name.partition(".")
        if field_name:
            by_component.setdefault(component, {})[field_name] = value
    return {component: _config(component, values, source) for component, values in by_component.items()}


def config_for(configs: dict[str, AdapterConfig] | None, component: str, source: str) -> AdapterConfig | None:
    """The config Diffusers builds for `component`, None without metadata. Metadata that has no field
    for a component the file has weights for makes Diffusers build `LoraConfig()` with no target
    modules, which PEFT refuses: a `LoraError` here."""
    if configs is None:
        return None
    if component not in configs:
        raise lora_error(
            source,
            f"the file's {METADATA_KEY} configures {', '.join(sorted(configs))} but not {component}, "
            f"which it has weights for (Diffusers cannot load such a file either)",
        )
    return configs[component]


def _config(component: str, values: dict[str, object], source: str) -> AdapterConfig:
    def number(name: str, default: float, integer: bool) -> float:
        value = values.get(name, default)
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if not ok or isinstance(value, bool) or (integer and value <= 0):
            kind = "a positive integer" if integer else "a number"
            raise lora_error(source, f"{METADATA_KEY} field {component}.{name} must be {kind}, got {value!r}")
        return value

    def pattern(name: str, integer: bool) -> dict:
        value = values.get(name) or {}
        if not isinstance(value, dict):
            raise lora_error(
                source, f"{METADATA_KEY} field {component}.{name} must be an object, got {value!r}"
            )
        for key, entry in value.items():
            number_ok = isinstance(entry, int) if integer else isinstance(entry, (int, float))
            if not number_ok or isinstance(entry, bool) or (integer and entry <= 0):
                raise lora_error(source, f"{METADATA_KEY} field {component}.{name}[{key!r}] is {entry!r}")
        return value

    return AdapterConfig(
        r=int(number("r", _PEFT_DEFAULT_R, integer=True)),
        lora_alpha=float(number("lora_alpha", _PEFT_DEFAULT_ALPHA, integer=False)),
        rank_pattern=pattern("rank_pattern", integer=True),
        alpha_pattern=pattern("alpha_pattern", integer=False),
        use_rslora=bool(values.get("use_rslora", False)),
        use_dora=bool(values.get("use_dora", False)),
    )
