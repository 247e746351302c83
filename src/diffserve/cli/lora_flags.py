"""What the LoRA flags of `serve` and `generate` make (the flags themselves are `EngineArgs`' declarations):
`LoraSpec`s and the LoRA fields' cross-checks.

`--lora [NAME=]PATH[:SCALE]` names an adapter file: NAME defaults to the file's stem, SCALE (a number) to
1.0. `serve` loads each at start (requests then name them; SCALE matters only with `--lora-merge`), takes
`--lora-dir` (the folder requests and `POST /v1/loras` may read adapters from) and `--max-lora-memory`.
`generate` (`one_off`) loads each and applies it to the prompts at SCALE. Nothing here imports torch: the
files are read when the model loads (`runtime/lora_registry.py`), and their errors end the command then.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from diffserve.configs.engine_args import LoraSpec
from diffserve.configs.memory_options import parse_size as parse_size  # `--max-lora-memory`'s SIZE
from diffserve.configs.sampling_params import LoraChoice
from diffserve.errors import UserError

#: What `--lora` takes, for its errors.
SPEC_FORMS = {
    False: "[NAME=]PATH[:SCALE]",  # serve
    True: "PATH[:SCALE] (or NAME=PATH[:SCALE])",  # generate
}


def parse_lora_spec(text: str, flag: str = "--lora", form: str = SPEC_FORMS[False]) -> LoraSpec:
    """`[NAME=]PATH[:SCALE]` -> LoraSpec; the file must exist. NAME= is recognised when the text before
    the first `=` has no path separator; `:SCALE` when the text after the last `:` is a number (else the
    colon is part of the path, unless what precedes it is a file: then SCALE is reported as no number)."""
    spec = text.strip()
    name: str | None = None
    head, eq, tail = spec.partition("=")
    if eq and head and not any(sep in head for sep in ("/", "\\")):
        name, spec = head.strip(), tail
    scale = 1.0
    path_text, colon, scale_text = spec.rpartition(":")
    if colon:
        try:
            scale = float(scale_text)
        except ValueError:
            if Path(path_text).expanduser().is_file():
                raise UserError(f"{flag} {text!r}: SCALE {scale_text!r} is not a number ({form})") from None
            path_text = spec  # a colon inside the path
        else:
            if not math.isfinite(scale):
                raise UserError(f"{flag} {text!r}: SCALE must be a finite number, got {scale_text!r}")
    else:
        path_text = spec
    if not path_text:
        raise UserError(f"{flag} {text!r}: no file given ({form})")
    path = Path(path_text).expanduser()
    if not path.is_file():
        what = "is a directory, not a LoRA file" if path.is_dir() else "does not exist"
        raise UserError(f"{flag} {text!r}: {str(path)!r} {what}")
    if name is None:
        name = path.stem
    if not name:
        raise UserError(f"{flag} {text!r}: the adapter's NAME is empty ({form})")
    return LoraSpec(name=name, path=str(path.absolute()), scale=scale)


def lora_specs(args: argparse.Namespace) -> list[LoraSpec]:
    """The `--lora` adapters, each name once."""
    form = SPEC_FORMS[args.command == "generate"]
    specs = [parse_lora_spec(text, "--lora", form) for text in args.loras]
    seen: dict[str, LoraSpec] = {}
    for spec in specs:
        if spec.name in seen:
            raise UserError(
                f"--lora: two adapters are named {spec.name!r} ({seen[spec.name].path} and {spec.path}); give "
                "one a name: --lora NAME=PATH"
            )
        seen[spec.name] = spec
    return specs


def lora_engine_fields(args: argparse.Namespace, values: dict[str, object]) -> dict[str, object]:
    """The EngineArgs LoRA fields: `values` (the flags' checked values, `namespace_values`) with the
    `--lora` adapters parsed and the flags' cross-checks applied; as given for a command without them."""
    if "loras" not in values:
        return values
    specs = lora_specs(args)
    if args.command == "generate":
        # A one-off run loads every adapter it was given: no budget to evict them by.
        return {**values, "loras": specs, "max_lora_memory": sys.maxsize}
    if values["lora_merge"] and not specs:
        raise UserError("--lora-merge merges the --lora adapters into the weights: pass at least one --lora")
    if values["lora_merge"] and values["lora_dir"] is not None:
        raise UserError(
            "--lora-merge and --lora-dir exclude each other: with merged adapters requests cannot choose any"
        )
    return {**values, "loras": specs}


def lora_choices_from(args: argparse.Namespace) -> list[LoraChoice]:
    """`generate`: every `--lora` adapter, applied to the prompts at its SCALE."""
    return [LoraChoice(spec.name, spec.scale) for spec in lora_specs(args)]
