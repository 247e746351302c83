"""The HTTP `cache` field: one typed object per cache method, made from its settings dataclass
(`configs/cache_settings.py`), so that the OpenAPI document lists every method with its settings, types,
bounds, defaults and help, and a request is checked by the same code as the CLI and the Python API."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from diffserve.configs.cache_settings import CACHE_METHODS, CacheSettings, parse_cache, setting_rule
from diffserve.errors import InvalidRequestError


def _json_type(hint: Any) -> Any:
    """A settings type as the request's: tuples are JSON lists."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        return list[typing.get_args(hint)[0]]  # type: ignore[valid-type]
    if origin is not None and typing.get_args(hint):
        args = tuple(_json_type(arg) for arg in typing.get_args(hint))
        return Union[args]  # noqa: UP007 (built from a tuple of types)
    return hint


def _model(cls: type[CacheSettings]) -> type[BaseModel]:
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {"method": (Literal[cls.method], Field(description=cls.summary))}  # type: ignore[valid-type]
    for f in dataclasses.fields(cls):
        rule = setting_rule(f)
        hint = _json_type(hints[f.name])
        if rule.choices is not None:
            hint = Literal[rule.choices]  # type: ignore[valid-type]
        scalar = hint in (int, float, int | None, float | None)
        bounds = {"ge": rule.min, "le": rule.max} if scalar else {}
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        given = {key: value for key, value in bounds.items() if value is not None}
        fields[f.name] = (hint, Field(default, description=rule.help, **given))
    name = "Cache" + "".join(part.title() for part in cls.method.split("_"))
    return create_model(name, __config__=ConfigDict(extra="forbid"), __doc__=cls.summary, **fields)


#: One model per method, told apart by `method`.
CacheModels = tuple(_model(cls) for cls in CACHE_METHODS.values())
CacheRequest = Annotated[Union[CacheModels], Field(discriminator="method")]  # noqa: UP007


def cache_field(value: Any) -> Any:
    """The `cache` field's validator (before the model's): JSON or "method:key=value" text (a multipart
    form's, or a CLI-style string) and objects are checked by `parse_cache`, whose errors name the methods
    or the method's settings; the object is then the typed model's input."""
    if value is None:
        return None
    try:
        settings = parse_cache(value)
    except InvalidRequestError as exc:
        raise ValueError(str(exc).removeprefix("cache: ")) from None
    return None if settings is None else settings.to_dict()


def cache_settings(value: BaseModel | None) -> CacheSettings | None:
    """The engine's settings of a validated `cache` field."""
    return None if value is None else parse_cache(json.loads(value.model_dump_json()))
