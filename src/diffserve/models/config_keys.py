"""Reading a Diffusers `config.json` into constructor kwargs or a config dataclass, the same way for every
native class."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Self, TypeVar

#: A frozen config dataclass (`FluxTransformerConfig`, ...).
ConfigT = TypeVar("ConfigT")


def checked_config_kwargs(config: Mapping[str, Any], known: Iterable[str], class_name: str) -> dict[str, Any]:
    """`config` without its `_`-prefixed metadata keys; a key the class does not know is an error.

    Diffusers only warns about unknown keys. Here they fail loudly: they mean the checkpoint expects
    behaviour the native class does not implement.
    """
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    known = set(known)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"{class_name} config has unknown keys {unknown}; known keys: {sorted(known)}")
    return kwargs


def per_block(owner: str, name: str, value: Any, count: int) -> tuple[Any, ...]:
    """A per-block config value as a tuple of `count`: a bare string or bool applies to every block (Diffusers'
    rule), a sequence must have `count` entries (ValueError naming `owner`'s key `name` otherwise)."""
    values = (value,) * count if isinstance(value, (str, bool)) else tuple(value)
    if len(values) != count:
        raise ValueError(f"{owner}: {name} needs {count} entries, got {len(values)}: {values}")
    return values


def check_choices(owner: str, name: str, values: Iterable[str], allowed: Iterable[str]) -> None:
    """ValueError naming `owner`'s key `name` and the first value that is not one of `allowed`."""
    allowed = tuple(allowed)
    for value in values:
        if value not in allowed:
            raise ValueError(f"{owner}: {name} {value!r} is not supported; supported: {allowed}")


def config_from_diffusers(config_cls: type[ConfigT], config: Mapping[str, Any], class_name: str) -> ConfigT:
    """`config_cls` (a dataclass whose fields are the Diffusers config keys) from a `config.json` dict.

    `_`-prefixed metadata keys are ignored and unknown keys are an error, as in `checked_config_kwargs`;
    keys the dict lacks take the dataclass's defaults.
    """
    known = [field.name for field in dataclasses.fields(config_cls)]
    return config_cls(**checked_config_kwargs(config, known, class_name))


class DiffusersConfigured:
    """Mixin of every native model class: `from_config(config_json_dict)` reads the Diffusers config the one
    way, into the config dataclass `config_class` (DiTs) or into constructor keywords (VAEs): those named by
    `config_defaults`, or else the constructor's keyword-only parameters. `_`-prefixed metadata is
    ignored and unknown keys are refused (`checked_config_kwargs`)."""

    diffusers_class_name: ClassVar[str]
    #: The frozen dataclass of the Diffusers config that the constructor takes, or None.
    config_class: ClassVar[type | None] = None
    #: Otherwise: the Diffusers config keys the constructor takes as keywords (their defaults as values).
    config_defaults: ClassVar[Mapping[str, Any] | None] = None

    @classmethod
    def config_keys(cls) -> frozenset[str]:
        """The Diffusers config names this class accepts."""
        if cls.config_class is not None:
            return frozenset(field.name for field in dataclasses.fields(cls.config_class))
        if cls.config_defaults is not None:
            return frozenset(cls.config_defaults)
        params = inspect.signature(cls.__init__).parameters.values()
        return frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """Build from a Diffusers `config.json` dict; `_`-prefixed metadata keys are ignored, unknown keys are
        an error, keys the dict lacks take the class's defaults."""
        if cls.config_class is not None:
            return cls(config_from_diffusers(cls.config_class, config, cls.diffusers_class_name))  # type: ignore[call-arg]
        return cls(**checked_config_kwargs(config, cls.config_keys(), cls.diffusers_class_name))
