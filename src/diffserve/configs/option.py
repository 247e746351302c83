"""Every option declared once: a dataclass field made with `option(...)` carries its default, its bounds,
its help and its command-line spelling, and the front ends are generated from it.

    max_inference_steps: int = option(1000, min=1, cli="--max-inference-steps", metavar="N",
                                      help="most denoising steps a request may ask for (default: 1000)")

What reads the declarations: `add_options` (the argparse flags of a command) and `namespace_values` (the
parsed flags back as field values, converted and bounds-checked: UserError naming the flag), here;
`keyword_values` and `option_keywords` (a Python entry point's keywords: exactly the declared fields,
checked the same way, TypeError naming close matches for any other); the HTTP request models'
fields (`server/schemas.py`: bounds and descriptions, so the OpenAPI document carries them).
`undeclared_fields` lists the fields made without `option`, which `tests/unit/test_option_surfaces.py`
refuses. Nothing here imports torch or pydantic.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, overload

from diffserve.errors import InvalidRequestError, UserError

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])

#: The key of a field's `metadata` that holds its `Option`.
METADATA_KEY = "diffserve.option"


class _FieldDefault:
    """The marker of `Option.front_end_default`: the front ends use the field's own default."""

    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT = _FieldDefault()


class DataclassInstance(Protocol):
    """What `dataclasses.fields` reads: a dataclass or its class."""

    __dataclass_fields__: typing.ClassVar[dict[str, dataclasses.Field[object]]]


@dataclass(frozen=True)
class OptionGroup:
    """A titled section of a command's `--help` (argparse's argument group) that options belong to."""

    title: str
    description: str


@dataclass(frozen=True)
class Option:
    """What one field declares beyond its type and default (see `option` for each part)."""

    help: str
    cli: str | None = None
    min: float | None = None
    max: float | None = None
    gt: float | None = None
    lt: float | None = None
    min_items: int | None = None
    max_items: int | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], object] | None = None
    convert: Callable[[str, str], object] | None = None
    repeat: bool = False
    commands: tuple[str, ...] | None = None
    group: OptionGroup | None = None
    http: bool = False
    env: str | None = None
    front_end_default: object = FIELD_DEFAULT

    def rule(self) -> str | None:
        """What a value must be, in words ("in (0, 1]", ">= 1", "one of int8, fp8"); None: anything."""
        if self.choices is not None:
            return f"one of {', '.join(self.choices)}"
        low = f"[{_number(self.min)}" if self.min is not None else None
        if self.gt is not None:
            low = f"({_number(self.gt)}"
        high = f"{_number(self.max)}]" if self.max is not None else None
        if self.lt is not None:
            high = f"{_number(self.lt)})"
        if low is not None and high is not None:
            return f"in {low}, {high}"
        if low is not None:
            return f">= {low[1:]}" if low.startswith("[") else f"> {low[1:]}"
        if high is not None:
            return f"<= {high[:-1]}" if high.endswith("]") else f"< {high[:-1]}"
        return None

    def allows(self, value: object) -> bool:
        """Whether `value` is within the declared bounds and choices (None, an unset value, always is;
        NaN never is where there are bounds).
        The bounds of a list option apply to each of its items, `min_items`/`max_items` to its length."""
        if value is None:
            return True
        if isinstance(value, (list, tuple)):
            if self.min_items is not None and len(value) < self.min_items:
                return False
            if self.max_items is not None and len(value) > self.max_items:
                return False
            return all(self.allows(item) for item in value)
        if self.choices is not None:
            return value in self.choices
        if self.rule() is None:
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return False  # infinity may be within the bounds (`--job-ttl inf`: kept for ever)
        return (
            (self.min is None or value >= self.min)
            and (self.max is None or value <= self.max)
            and (self.gt is None or value > self.gt)
            and (self.lt is None or value < self.lt)
        )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


class OptionKeywords(typing.TypedDict, total=False):
    """What `option` takes besides the default and `help` (each part is described there); the fields of
    `Option`, whose defaults are the keywords' defaults."""

    cli: str | None
    min: float | None
    max: float | None
    gt: float | None
    lt: float | None
    min_items: int | None
    max_items: int | None
    choices: Iterable[str] | None
    metavar: str | None
    parse: Callable[[str], object] | None
    convert: Callable[[str, str], object] | None
    repeat: bool
    commands: Iterable[str] | None
    group: OptionGroup | None
    http: bool
    env: str | None
    front_end_default: object


@overload
def option(default: T, *, help: str, **keywords: Unpack[OptionKeywords]) -> T: ...
@overload
def option(*, default_factory: Callable[[], T], help: str, **keywords: Unpack[OptionKeywords]) -> T: ...
@overload
def option(  # a required field: no default
    *, help: str, cli: str | None = None, metavar: str | None = None,
    convert: Callable[[str, str], object] | None = None, commands: Iterable[str] | None = None,
    group: OptionGroup | None = None, http: bool = False,
) -> typing.Any: ...  # fmt: skip
def option(
    default: object = dataclasses.MISSING,
    *,
    default_factory: Callable[[], object] | None = None,
    help: str,
    **keywords: Unpack[OptionKeywords],
) -> typing.Any:
    """A dataclass field declaring an option. `default` (or `default_factory`; neither: a required field)
    is the field's default, and the flag's and keyword's. `help`: one text for `--help` and the OpenAPI
    description. `cli`: the flag's spelling (None: no flag). `min`/`max` (inclusive), `gt`/`lt`
    (exclusive) and `choices` bound the value (each item's, for a list; `min_items`/`max_items` its
    length); `metavar` names the flag's value in `--help`. `parse`: the flag's argparse `type` (default:
    the field's type); `convert(text, flag)`: a text value (typed, or a str default) turned into the
    field's value after parsing, raising UserError naming the flag (sizes such as "2GiB", paths that must
    exist). `repeat`: the flag is given once per item (argparse's append; else a list takes "+" values).
    `commands`: the subcommands whose parser has the flag (None: every one that adds this dataclass's
    options). `group`: the `--help` section. `http`: a field of the HTTP request bodies. `env`: an
    environment variable the flag's default is read from. `front_end_default`: the flag's and the HTTP
    field's default when it is not the field's (the seed: unset there, then drawn at random)."""
    choices, commands = keywords.pop("choices", None), keywords.pop("commands", None)
    spec = Option(
        help=help,
        choices=None if choices is None else tuple(choices),
        commands=None if commands is None else tuple(commands),
        **keywords,
    )
    metadata = {METADATA_KEY: spec}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DeclaredOption:
    """One field's declaration, with what its dataclass says: name, type and default."""

    name: str
    spec: Option
    #: The field's type, resolved (`int | None`, `list[int]`).
    type: object
    #: The field's default (a fresh one from its factory); `dataclasses.MISSING` for a required field.
    default: object

    @property
    def base_type(self) -> object:
        """The type without `None`; for a list, its items' type (`int | None` -> int, `list[str]` -> str)."""
        base = _without_none(self.type)
        return typing.get_args(base)[0] if self.is_list else base

    @property
    def is_list(self) -> bool:
        return typing.get_origin(_without_none(self.type)) is list

    @property
    def front_end_default(self) -> object:
        """The default at the CLI and the HTTP API: `Option.front_end_default` when declared, else the
        field's (None for a required field); `env`, when set in the environment, for the flag."""
        if self.spec.env is not None and self.spec.env in os.environ:
            return os.environ[self.spec.env]
        if self.spec.front_end_default is not FIELD_DEFAULT:
            return self.spec.front_end_default
        return None if self.default is dataclasses.MISSING else self.default


def _without_none(hint: object) -> object:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


@functools.cache
def _type_hints(cls: type[DataclassInstance]) -> dict[str, object]:
    return typing.get_type_hints(cls)


def options(cls: type[DataclassInstance]) -> list[DeclaredOption]:
    """The declared options of dataclass `cls`, in field order (a factory's default: a fresh value)."""
    hints = _type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(METADATA_KEY)
        if spec is None:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        found.append(DeclaredOption(f.name, spec, hints[f.name], default))
    return found


def option_of(cls: type[DataclassInstance], name: str) -> DeclaredOption:
    """Field `name`'s declaration (KeyError when it has none)."""
    for declared in options(cls):
        if declared.name == name:
            return declared
    raise KeyError(f"{cls.__name__}.{name} is not declared with option()")


def undeclared_fields(cls: type[DataclassInstance]) -> list[str]:
    """The fields of `cls` made without `option` (every field must declare itself)."""
    return [f.name for f in dataclasses.fields(cls) if METADATA_KEY not in f.metadata]


# ------------------------------------------------------------------------------------- the command line


def add_options(
    parser: argparse.ArgumentParser, cls: type[DataclassInstance], command: str,
    only: Iterable[str] | None = None, skip: Iterable[str] = (),
) -> None:  # fmt: skip
    """Add a flag for each option of `cls` that has a `cli` spelling and is declared for `command`
    (`only`/`skip`: by field name), in its `--help` group. The flag's dest is the field's name."""
    wanted, skipped = None if only is None else set(only), set(skip)
    groups: dict[OptionGroup, argparse._ArgumentGroup] = {}
    for declared in options(cls):
        spec = declared.spec
        if (
            spec.cli is None
            or declared.name in skipped
            or (wanted is not None and declared.name not in wanted)
        ):
            continue
        if spec.commands is not None and command not in spec.commands:
            continue
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if spec.group is not None:
            if spec.group not in groups:
                groups[spec.group] = parser.add_argument_group(spec.group.title, spec.group.description)
            target = groups[spec.group]
        add_option(target, declared)


def add_option(target: argparse.ArgumentParser | argparse._ArgumentGroup, declared: DeclaredOption) -> None:
    """Add `declared`'s flag to `target` (a parser, an argument group or a mutually exclusive group)."""
    spec, default = declared.spec, declared.front_end_default
    assert spec.cli is not None, f"{declared.name} has no command-line spelling"
    if declared.base_type is bool and not declared.is_list:
        action = argparse.BooleanOptionalAction if default else "store_true"
        target.add_argument(spec.cli, dest=declared.name, action=action, default=default, help=spec.help)
        return
    settings: dict[str, object] = {"dest": declared.name, "default": default, "help": spec.help}
    value_type = spec.parse or (str if spec.convert is not None else declared.base_type)
    assert value_type in (int, float, str) or spec.parse is not None, f"{declared.name}: declare its parse"
    if value_type is not str:
        settings["type"] = value_type
    if declared.is_list:
        settings["action" if spec.repeat else "nargs"] = "append" if spec.repeat else "+"
    if spec.choices is not None:
        settings["choices"] = spec.choices
    if spec.metavar is not None:
        settings["metavar"] = spec.metavar
    target.add_argument(spec.cli, **settings)  # type: ignore[arg-type]


def namespace_values(cls: type[DataclassInstance], namespace: argparse.Namespace) -> dict[str, object]:
    """The values of `cls`'s options that the parsed `namespace` holds (a flag the command did not add is
    absent: its field keeps its default), each converted (`Option.convert`) and within its bounds, else a
    UserError naming the flag and what it must be."""
    given = vars(namespace)
    values: dict[str, object] = {}
    for declared in options(cls):
        spec = declared.spec
        if spec.cli is None or declared.name not in given:
            continue
        values[declared.name] = checked_value(declared, given[declared.name], spec.cli)
    return values


def checked_value(declared: DeclaredOption, value: object, name: str) -> object:
    """`value` converted when it is text and has a `convert`, then checked against the declared bounds
    (UserError "`name` must be RULE, got VALUE"). `name`: the flag or keyword the value came from."""
    if isinstance(value, os.PathLike) and declared.base_type is str:
        value = os.fspath(value)
    if declared.spec.convert is not None and isinstance(value, str):
        value = declared.spec.convert(value, name)
    if not declared.spec.allows(value):
        raise UserError(f"{name} must be {_rule_of(declared)}, got {value!r}")
    return value


def _rule_of(declared: DeclaredOption) -> str:
    spec = declared.spec
    rule = spec.rule() or "valid"
    if declared.is_list and (spec.min_items is not None or spec.max_items is not None):
        count = (
            f"{spec.min_items or 0}..{spec.max_items}"
            if spec.max_items is not None
            else f">= {spec.min_items}"
        )
        return f"a list of {count} values, each {rule}"
    return rule


# ------------------------------------------------------------------------------------- Python keywords


def keyword_values(
    cls: type[DataclassInstance], keywords: Mapping[str, object], caller: str, accepted: Iterable[str] = ()
) -> dict[str, object]:
    """`keywords` of a Python entry point taking `cls`'s options as keywords, checked as the flags are
    (`checked_value`, naming the keyword). A keyword that is neither a declared option nor one of
    `accepted` (the entry point's own) is a TypeError, as Python's own, naming the closest ones."""
    declared = {d.name: d for d in options(cls)}
    valid = [*declared, *accepted]
    for name in keywords:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")
    return {
        name: checked_value(declared[name], value, name)
        for name, value in keywords.items()
        if name in declared
    }


def option_keywords(cls: type[DataclassInstance], skip: Iterable[str] = ()) -> Callable[[F], F]:
    """Decorate a function taking `**options` (checked with `keyword_values`): its signature, as
    `inspect.signature` and `help()` show it, lists each option of `cls` (but `skip`) as a keyword-only
    parameter with its declared default and type, in place of the `**options`."""
    skipped = set(skip)

    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        declared = [
            inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=d.default, annotation=d.type)
            for d in options(cls)
            if d.name not in skipped and d.default is not dataclasses.MISSING
        ]
        function.__signature__ = signature.replace(parameters=[*kept, *declared])  # type: ignore[attr-defined]
        return function

    return decorate


# ------------------------------------------------------------------------------------- family settings


#: How messages name a setting's type.
_KIND_NAMES: dict[object, str] = {float: "number", int: "integer", str: "string"}


def _matches_type(value: object, hint: object) -> bool:
    """Whether a JSON-like `value` is of the declared scalar type `hint` (an int passes for a float; a bool
    is never a number)."""
    if hint is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int)
    return not isinstance(hint, type) or isinstance(value, hint)


def settings_from(
    cls: type[T], values: Mapping[str, object], what: str, allowed: Iterable[str] | None = None
) -> T:
    """A family's settings dataclass (its fields declared with `option`) from a request's untyped mapping
    (`SamplingParams.extra`): every key one of `allowed` (default: every declared field), every value of
    the field's type (a list for a tuple or list field, each item of its item type) and within its
    declared bounds; else an InvalidRequestError naming `what[key]` and what it accepts. Missing keys take
    the declared defaults; a number given for a float field becomes a float, a list a tuple."""
    declared = {d.name: d for d in options(cls)}  # type: ignore[arg-type]
    names = list(declared) if allowed is None else list(allowed)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise InvalidRequestError(
            f"{what} has unknown setting(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(names)}",
            param=what,
        )
    checked: dict[str, object] = {}
    for name, value in values.items():
        option_ = declared[name]
        base = _without_none(option_.type)
        sequence = typing.get_origin(base) in (list, tuple)
        item_type = typing.get_args(base)[0] if sequence else base
        if value is None and option_.type is not base:  # an optional setting left unset
            checked[name] = None
            continue
        items = value if sequence and isinstance(value, (list, tuple)) else None
        typed = (
            items is not None and all(_matches_type(item, item_type) for item in items)
            if sequence
            else _matches_type(value, item_type)
        )
        if not typed or not option_.spec.allows(value):
            kind = _KIND_NAMES.get(item_type, getattr(item_type, "__name__", str(item_type)))
            shape = (
                f"a list of {kind}s" if sequence else ("true or false" if item_type is bool else f"a {kind}")
            )
            rule = option_.spec.rule()
            raise InvalidRequestError(
                f"{what}[{name!r}] must be {shape}{f' {rule}' if rule else ''}, got {value!r}",
                param=what,
            )
        if sequence:
            checked[name] = tuple(float(i) if item_type is float else i for i in value)  # type: ignore[union-attr]
        else:
            checked[name] = float(value) if item_type is float else value  # type: ignore[arg-type]
    return cls(**checked)
