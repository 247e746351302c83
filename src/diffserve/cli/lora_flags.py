"""LoRA flags of `serve` and `generate`, and what they make: `LoraSpec`s and the EngineArgs LoRA fields.

`--lora [NAME=]PATH[:SCALE]` names an adapter file: NAME defaults to the file's stem, SCALE (a number) to
1.0. `serve` loads each at start (requests then name them; SCALE matters only with `--lora-merge`), takes
`--lora-dir` (the folder requests and `POST /v1/loras` may read adapters from) and `--max-lora-memory`.
`generate` (`one_off`) loads each and applies it to the prompts at SCALE. Nothing here imports torch: the
files are read when the model loads (`runtime/lora_registry.py`), and their errors end the command then.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from diffserve.configs.engine_args import EngineArgs, LoraSpec
from diffserve.configs.sampling_params import LoraChoice
from diffserve.errors import UserError

#: `--max-lora-memory` units (case-insensitive): binary for KiB/K/Ki, decimal for KB (as `ls -h`/SI).
SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "ki": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mi": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gi": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "ti": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
#: What `--lora` takes, for its help and its errors.
SPEC_FORMS = {
    False: "[NAME=]PATH[:SCALE]",  # serve
    True: "PATH[:SCALE] (or NAME=PATH[:SCALE])",  # generate
}


def add_lora_flags(parser: argparse.ArgumentParser, one_off: bool) -> None:
    """`generate`'s flags (`one_off`: --lora applies to the generated prompts) or `serve`'s."""
    g = parser.add_argument_group(
        "LoRA adapters",
        "diffusers/PEFT, kohya and FLUX community LoRA files (.safetensors), applied to the DiT",
    )
    add = g.add_argument
    if one_off:
        add("--lora", dest="lora", action="append", default=None, metavar="PATH[:SCALE]",
            help="a LoRA file applied to every prompt at SCALE (default 1.0; repeat for several, e.g. "
            "--lora ink.safetensors:0.8 --lora detail.safetensors)")  # fmt: skip
        parser.set_defaults(lora_one_off=True)
        return
    add("--lora", dest="lora", action="append", default=None, metavar="[NAME=]PATH[:SCALE]",
        help="a LoRA file loaded at start as NAME (default: the file's stem), which requests apply with "
        '"loras": [{"name": NAME, "scale": 0.8}]; repeatable. SCALE only matters with --lora-merge')  # fmt: skip
    add("--lora-dir", default=None, metavar="DIR",
        help="folder of LoRA files: requests may name any NAME.safetensors in it (read on first use) and "
        "POST /v1/loras loads files from it; nothing outside it is read (default: none)")  # fmt: skip
    add("--lora-merge", action="store_true",
        help="merge the --lora adapters into the weights at their SCALE at start: no per-step cost, but "
        "requests cannot choose adapters")  # fmt: skip
    add("--max-lora-memory", default=None, metavar="SIZE",
        help="device memory the loaded adapters may take, in bytes or with a unit (512MiB, 2GiB); past it the "
        "least recently used idle one is unloaded (read again when named). Kept out of the requests' memory "
        "budget while LoRA is on (default: 2GiB)")  # fmt: skip
    parser.set_defaults(lora_one_off=False)


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


def parse_size(text: str, flag: str) -> int:
    """Bytes from `SIZE`: a number of bytes, or with a unit of SIZE_UNITS (`512MiB`, `2GiB`, `1.5G`)."""
    match = _SIZE.match(text)
    unit = SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise UserError(
            f"{flag} must be a size in bytes, or with a unit such as 512MiB or 2GiB (KiB, MiB, GiB, TiB; "
            f"KB, MB, GB, TB are powers of 1000), got {text!r}"
        )
    size = int(float(match.group(1)) * unit)
    if size < 1:
        raise UserError(f"{flag} must be at least 1 byte, got {text!r}")
    return size


def lora_specs(args: argparse.Namespace) -> list[LoraSpec]:
    """The `--lora` adapters, each name once."""
    form = SPEC_FORMS[bool(args.lora_one_off)]
    specs = [parse_lora_spec(text, "--lora", form) for text in args.lora or []]
    seen: dict[str, LoraSpec] = {}
    for spec in specs:
        if spec.name in seen:
            raise UserError(
                f"--lora: two adapters are named {spec.name!r} ({seen[spec.name].path} and {spec.path}); give "
                "one a name: --lora NAME=PATH"
            )
        seen[spec.name] = spec
    return specs


def lora_engine_fields(args: argparse.Namespace) -> dict[str, object]:
    """The EngineArgs LoRA fields from the flags; {} for a command without them (`calibrate-cache`)."""
    if "lora_one_off" not in vars(args):
        return {}
    specs = lora_specs(args)
    if args.lora_one_off:
        # A one-off run loads every adapter it was given: no budget to evict them by.
        return {"loras": specs, "max_lora_memory": sys.maxsize}
    lora_dir = None
    if args.lora_dir is not None:
        folder = Path(args.lora_dir).expanduser()
        if not folder.is_dir():
            raise UserError(f"--lora-dir {args.lora_dir!r} is not a directory")
        lora_dir = str(folder.absolute())
    if args.lora_merge and not specs:
        raise UserError("--lora-merge merges the --lora adapters into the weights: pass at least one --lora")
    if args.lora_merge and lora_dir is not None:
        raise UserError(
            "--lora-merge and --lora-dir exclude each other: with merged adapters requests cannot choose any"
        )
    max_bytes = EngineArgs.max_lora_memory
    if args.max_lora_memory is not None:
        max_bytes = parse_size(args.max_lora_memory, "--max-lora-memory")
    return {"loras": specs, "lora_dir": lora_dir, "lora_merge": args.lora_merge, "max_lora_memory": max_bytes}


def lora_choices_from(args: argparse.Namespace) -> list[LoraChoice]:
    """`generate`: every `--lora` adapter, applied to the prompts at its SCALE."""
    return [LoraChoice(spec.name, spec.scale) for spec in lora_specs(args)]
