"""The memory options' allowed values and their checks, shared by the CLI flags, the Python API and the
server (torch-free): quantization modes, offload modes, single-file DiT weight formats."""

from __future__ import annotations

import re
from pathlib import Path

from diffserve.errors import UserError

#: `--quantization`, of the DiT's Linears, per output channel: weight-only (int8, fp8), or FP8 compute
#: with per-token activation scales (fp8-dynamic: NVIDIA compute capability >= 8.9 only).
QUANTIZATION_MODES = ("int8", "fp8", "fp8-dynamic")
#: `--offload`: "auto" plans the offloads from free memory; "none" applies only the explicit flags.
OFFLOAD_MODES = ("none", "auto")
#: `--transformer-weights` file kinds, by suffix.
TRANSFORMER_WEIGHT_SUFFIXES = (".safetensors", ".gguf")
#: Units of a SIZE (`--max-memory`, `--max-lora-memory`; case-insensitive): binary for KiB/K/Ki, decimal
#: for KB (as `ls -h`/SI).
SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "ki": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mi": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gi": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "ti": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


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


def check_quantization(mode: str | None, flag: str = "--quantization") -> str | None:
    """`mode` if allowed (None: full precision), else a UserError naming the allowed values."""
    if mode is None or mode in QUANTIZATION_MODES:
        return mode
    raise UserError(f"{flag} must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")


def check_offload(mode: str, flag: str = "--offload") -> str:
    if mode in OFFLOAD_MODES:
        return mode
    raise UserError(f"{flag} must be one of {', '.join(OFFLOAD_MODES)}, got {mode!r}")


def check_transformer_weights(path: str | None, flag: str = "--transformer-weights") -> str | None:
    """An existing `.safetensors` or `.gguf` file (None: the folder's own DiT weights)."""
    if path is None:
        return None
    file = Path(path).expanduser()
    if file.suffix not in TRANSFORMER_WEIGHT_SUFFIXES:
        raise UserError(f"{flag} must be a {' or '.join(TRANSFORMER_WEIGHT_SUFFIXES)} file, got {path!r}")
    if not file.is_file():
        raise UserError(f"{flag} {path!r} does not exist or is not a file")
    return str(file.absolute())
