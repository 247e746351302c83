"""The memory options' allowed values and their checks, shared by the CLI flags, the Python API and the
server (torch-free): weight-only quantization modes, offload modes, single-file DiT weight formats."""

from __future__ import annotations

from pathlib import Path

from diffserve.errors import UserError

#: `--quantization`: weight-only, per output channel, of the DiT's Linears.
QUANTIZATION_MODES = ("int8", "fp8")
#: `--offload`: "auto" plans the offloads from free memory; "none" applies only the explicit flags.
OFFLOAD_MODES = ("none", "auto")
#: `--transformer-weights` file kinds, by suffix.
TRANSFORMER_WEIGHT_SUFFIXES = (".safetensors", ".gguf")


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
