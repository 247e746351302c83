"""Reading a Diffusers `config.json` into constructor kwargs or a config dataclass, the same way for every
native class."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

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


def config_from_diffusers(config_cls: type[ConfigT], config: Mapping[str, Any], class_name: str) -> ConfigT:
    """`config_cls` (a dataclass whose fields are the Diffusers config keys) from a `config.json` dict.

    `_`-prefixed metadata keys are ignored and unknown keys are an error, as in `checked_config_kwargs`;
    keys the dict lacks take the dataclass's defaults.
    """
    known = [field.name for field in dataclasses.fields(config_cls)]
    return config_cls(**checked_config_kwargs(config, known, class_name))
