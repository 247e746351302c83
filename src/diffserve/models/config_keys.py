"""Reading a Diffusers `config.json` into constructor kwargs, the same way for every native class."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


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
