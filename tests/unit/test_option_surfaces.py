"""Issue 30: every option is declared once (`configs/option.py`), and each surface it is declared for shows
it with the declared default and bounds: the CLI flags of `generate`, `serve` and `calibrate-cache`, the
HTTP request bodies in the OpenAPI document (SamplingParams' `http=True` options), and the Python keywords
of `DiffGenerator.from_pretrained` and `DiffGenerator.generate`. A field added without a declaration fails
here, as does a surface that drifts from its declaration."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from diffserve.cli.main import build_parser
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.option import (
    DataclassInstance,
    DeclaredOption,
    namespace_values,
    option,
    options,
    undeclared_fields,
)
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, UserError
from diffserve.server.args import ServerArgs

#: The subcommands whose flags each dataclass's options are (an option's `commands` narrows them).
COMMANDS: dict[type, tuple[str, ...]] = {
    EngineArgs: ("generate", "serve", "calibrate-cache"),
    SamplingParams: ("generate",),
    ServerArgs: ("serve",),
}
#: Fields that are no option: the engine's settings inside the server's.
NOT_OPTIONS = {ServerArgs: {"engine_args"}}


def declared_cli_options() -> Iterator[tuple[type[DataclassInstance], DeclaredOption, str]]:
    for cls, commands in COMMANDS.items():
        for declared in options(cls):
            if declared.spec.cli is None:
                continue
            every = ("generate", "serve", "calibrate-cache") if declared.name == "log_level" else commands
            for command in declared.spec.commands or every:
                yield cls, declared, command


CLI_CASES = list(declared_cli_options())


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return build_parser().subcommands  # type: ignore[attr-defined]


def flag_action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((action for action in parser._actions if flag in action.option_strings), None)


# -- every field declares itself -------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(COMMANDS), ids=lambda cls: cls.__name__)
def test_every_field_is_declared(cls: type[DataclassInstance]) -> None:
    assert set(undeclared_fields(cls)) == NOT_OPTIONS.get(cls, set()), (
        f"declare every {cls.__name__} field with option(...) (configs/option.py): its help, bounds and "
        "CLI spelling then reach every surface"
    )


def test_a_field_without_a_declaration_is_caught() -> None:
    @dataclasses.dataclass
    class Grown(EngineArgs):
        new_knob: int = 3

    assert undeclared_fields(Grown) == ["new_knob"]

    @dataclasses.dataclass
    class Declared(EngineArgs):
        new_knob: int = option(3, min=1, help="a knob")

    assert undeclared_fields(Declared) == []


def test_flag_spellings_are_unique() -> None:
    spellings = [(d.spec.cli, cls) for cls in COMMANDS for d in options(cls) if d.spec.cli is not None]
    flags = [flag for flag, _ in spellings]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)


# -- the command line --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "declared", "command"), CLI_CASES, ids=[f"{c} {d.spec.cli}" for _, d, c in CLI_CASES]
)
def test_cli_flag_matches_its_declaration(parsers, cls, declared: DeclaredOption, command: str) -> None:
    action = flag_action(parsers[command], declared.spec.cli)
    assert action is not None, f"{command} has no {declared.spec.cli}"
    assert action.dest == declared.name
    assert action.default == declared.front_end_default
    assert action.help is not None and action.help.startswith(declared.spec.help)
    assert (tuple(action.choices) if action.choices is not None else None) == declared.spec.choices


def test_flags_are_on_the_declared_commands_only(parsers) -> None:
    for cls, commands in COMMANDS.items():
        for declared in options(cls):
            if declared.spec.cli is None or declared.spec.commands is None:
                continue
            for command in set(commands) - set(declared.spec.commands):
                assert flag_action(parsers[command], declared.spec.cli) is None, (command, declared.spec.cli)


def test_default_flags_make_the_default_args(parsers) -> None:
    """No flag given: the command's EngineArgs and ServerArgs are the dataclasses' defaults."""
    from diffserve.cli.engine_flags import engine_args_from

    args = build_parser().parse_args(["serve", "--model-path", "/m"])
    engine_args = engine_args_from(args)
    assert engine_args == EngineArgs(model_path="/m")
    server_values = namespace_values(ServerArgs, args)
    if "DIFFSERVE_API_KEY" not in os.environ:  # else --api-key defaults to it
        assert ServerArgs(engine_args, **server_values) == ServerArgs(engine_args)  # type: ignore[arg-type]


def outside(declared: DeclaredOption) -> list[object]:
    """Values just outside the declared bounds (each item's, for a list option)."""
    spec, integer = declared.spec, declared.base_type is int
    step = 1 if integer else 0.5
    values: list[object] = []
    for bound, delta in ((spec.min, -step), (spec.max, step), (spec.gt, 0), (spec.lt, 0)):
        if bound is not None:
            values.append(int(bound + delta) if integer else float(bound + delta))
    if declared.is_list:
        values = [[value] for value in values]
        if spec.min_items:
            values.append([])
        if spec.max_items is not None:
            values.append(list(range(spec.max_items + 1)))
    return values


def inside(declared: DeclaredOption) -> list[object]:
    """Values on the declared bounds, which are allowed."""
    spec, step = declared.spec, 1 if declared.base_type is int else 0.5
    values: list[object] = [bound for bound in (spec.min, spec.max) if bound is not None]
    values += [spec.gt + step] if spec.gt is not None else []
    values += [spec.lt - 1] if spec.lt is not None else []
    values = [int(v) if declared.base_type is int else float(v) for v in values]
    return [[value] for value in values] if declared.is_list else values


def bounded(cls: type[DataclassInstance]) -> list[DeclaredOption]:
    return [d for d in options(cls) if d.spec.rule() is not None and d.spec.choices is None]


SERVE_BOUNDED = [d for cls in (EngineArgs, ServerArgs) for d in bounded(cls) if d.spec.cli is not None]


@pytest.mark.parametrize("declared", SERVE_BOUNDED, ids=lambda d: d.spec.cli)
def test_cli_bounds_are_the_declared_ones(declared: DeclaredOption) -> None:
    """A flag beyond its declared bounds is one error naming the flag and the rule; on them it passes."""
    parser = build_parser()
    cls = EngineArgs if declared.name in {d.name for d in options(EngineArgs)} else ServerArgs

    def parse(value: object):
        return parser.parse_args(["serve", "--model-path", "/m", declared.spec.cli, str(value)])

    for value in outside(declared):
        with pytest.raises(UserError) as info:
            namespace_values(cls, parse(value))
        if declared.spec.convert is None:
            assert str(info.value).startswith(f"{declared.spec.cli} must be {declared.spec.rule()}, got ")
        else:  # a SIZE: its own words ("must be at least 1 byte")
            assert str(info.value).startswith(f"{declared.spec.cli} must be ")
    for value in inside(declared):
        assert namespace_values(cls, parse(value))[declared.name] == value


@pytest.mark.parametrize("declared", bounded(SamplingParams), ids=lambda d: d.name)
def test_sampling_bounds_are_checked_as_declared(declared: DeclaredOption) -> None:
    """The model-free checks (what `generate` runs on its flags, and the API on its keywords) refuse what
    the declaration excludes, naming the field, and take its bounds themselves."""
    finite = [math.inf, -math.inf, math.nan] if declared.base_type is float else []  # as HTTP: finite
    for value in [*outside(declared), *finite]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(prompt="a fox", **{declared.name: value}).check_values()
        assert info.value.param == declared.name and declared.name in str(info.value), value
    for value in inside(declared):
        SamplingParams(prompt="a fox", **{declared.name: value}).check_values()


# -- the HTTP API --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def request_properties(tmp_path_factory) -> dict[str, list[tuple[dict, bool]]]:
    """Every request body property of the OpenAPI document, by name: (its schema, whether required)."""
    from diffserve.server.app import create_app

    out = tmp_path_factory.mktemp("outputs")
    app = create_app(ServerArgs(EngineArgs(model_path="/m", output_path=str(out))))
    document = app.openapi()
    components = document.get("components", {}).get("schemas", {})
    found: dict[str, list[tuple[dict, bool]]] = {}
    for operations in document["paths"].values():
        for operation in operations.values():
            content = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if content is None:
                continue
            schema = content["schema"]
            if "$ref" in schema:
                schema = components[schema["$ref"].rsplit("/", 1)[1]]
            for name, prop in schema.get("properties", {}).items():
                found.setdefault(name, []).append((prop, name in schema.get("required", [])))
    return found


def value_schema(prop: dict) -> dict:
    """The non-null branch of an optional property's schema."""
    branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    assert len(branches) == 1, prop
    return branches[0]


HTTP_OPTIONS = [d for d in options(SamplingParams) if d.spec.http]


@pytest.mark.parametrize("declared", HTTP_OPTIONS, ids=lambda d: d.name)
def test_http_fields_match_their_declaration(request_properties, declared: DeclaredOption) -> None:
    spec = declared.spec
    assert declared.name in request_properties, f"no request body has {declared.name}"
    for prop, required in request_properties[declared.name]:
        if not required:
            assert prop.get("default") == declared.front_end_default
        assert prop["description"].startswith(spec.help)
        value = value_schema(prop)
        if declared.is_list:
            assert value.get("minItems") == spec.min_items and value.get("maxItems") == spec.max_items
            value = value["items"]
        if "$ref" in value:  # LoRA entries: objects, checked by `lora_entries` and the engine
            continue
        assert value.get("minimum") == spec.min and value.get("maximum") == spec.max
        assert value.get("exclusiveMinimum") == spec.gt and value.get("exclusiveMaximum") == spec.lt
        if "enum" in value:
            assert tuple(value["enum"]) == spec.choices
        elif spec.choices is not None:  # the engine checks these (a family's tiers): the help names them
            assert all(choice in spec.help for choice in spec.choices)


def test_sampling_fields_over_http_are_declared_for_it(request_properties) -> None:
    """A request field named as a SamplingParams field is that field (`schemas.sampling_params`): it must
    be declared `http=True`, so that its bounds and help come from the declaration."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    declared_http = {d.name for d in HTTP_OPTIONS}
    assert names & set(request_properties) == declared_http


# -- the Python API -----------------------------------------------------------------------------------


def test_from_pretrained_keywords_are_the_engine_options() -> None:
    from diffserve.api import DiffGenerator

    parameters = inspect.signature(DiffGenerator.from_pretrained).parameters
    keywords = {name: p.default for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    keywords.pop("show_progress")
    assert keywords == {d.name: d.default for d in options(EngineArgs) if d.name != "model_path"}


def test_from_pretrained_refuses_unknown_keywords_and_bad_values(tmp_path: Path) -> None:
    from diffserve.api import DiffGenerator

    missing = tmp_path / "no-model"
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_gpu'; did you mean 'num_gpus'"):
        DiffGenerator.from_pretrained(missing, num_gpu=2)
    with pytest.raises(UserError, match=r"^dist_timeout must be >= 1, got 0$"):
        DiffGenerator.from_pretrained(missing, dist_timeout=0)
    with pytest.raises(UserError, match=r"^offload must be one of none, auto, got 'always'$"):
        DiffGenerator.from_pretrained(missing, offload="always")
    with pytest.raises(UserError, match=r"^max_memory must be a size in bytes"):
        DiffGenerator.from_pretrained(missing, max_memory="lots")


def test_generate_keywords_are_the_sampling_options() -> None:
    from diffserve.api import check_generate_keywords

    check_generate_keywords({d.name: d.default for d in options(SamplingParams) if d.name != "prompt"})
    with pytest.raises(InvalidRequestError, match="did you mean 'guidance_scale'"):
        check_generate_keywords({"guidance": 3.0})
