"""Reading a LoRA adapter file: one `.safetensors` file, or a folder holding exactly one (as Diffusers'
`save_lora_weights` writes `pytorch_lora_weights.safetensors`).

The header is checked before safetensors parses it, so a truncated, corrupt or foreign file is
refused with what is wrong with it (not a parser's internals): a header longer than
MAX_LORA_HEADER_BYTES is refused without reading it, one declaring more than MAX_LORA_TENSORS tensors
before it is parsed, one nested too deeply as corrupt; tensors that are not floating point (but for an
integer `alpha` scalar) or hold no element (a rank-0 adapter) are refused from the header, and tensors
holding NaN or infinity once read. The tensors are copied out of the file (no memory map of it stays
open, and rewriting the file later changes nothing loaded). Pickle checkpoints (`.bin`, `.pt`, `.ckpt`)
are refused: loading them runs code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from diffserve.errors import LoraError

SUFFIX = ".safetensors"
_HEADER_LENGTH_BYTES = 8
#: The most bytes a LoRA file's JSON header may take (safetensors allows 100 MB; a real adapter's header,
#: kohya's training metadata included, takes well under 1 MiB).
MAX_LORA_HEADER_BYTES = 16 * 2**20
#: The most tensors a LoRA file may declare (a full FLUX or Wan LoRA with its text encoders: ~2,000).
MAX_LORA_TENSORS = 16_384
#: safetensors' dtype names of floating-point tensors (the only ones a LoRA's factors may be).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)


def read_lora_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a LoRA file (on CPU, in the file's dtypes) and its safetensors metadata
    (`__metadata__`, empty when absent). `LoraError` naming the path for a missing, foreign, truncated
    or corrupt file."""
    file = lora_file_checked(path)
    _check_header(file)
    tensors = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                tensor = f.get_tensor(key)
                _check_finite(file, key, tensor)
                tensors[key] = tensor.clone()  # memory of its own: no map of the file stays open
    except _READ_ERRORS as exc:
        raise LoraError(f"cannot read LoRA file {file}: the file is corrupt ({exc})") from exc
    return tensors, dict(metadata)


def _check_finite(file: Path, key: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor holding NaN or infinity: applied, it turns every image black."""
    if not tensor.is_floating_point():
        return
    values = tensor.float() if tensor.element_size() == 1 else tensor  # fp8 has no isfinite
    if not bool(torch.isfinite(values).all()):
        raise LoraError(
            f"LoRA file {file} is unusable: tensor {key!r} holds NaN or infinite values (an adapter with them "
            "turns every image black)"
        )


def lora_file_checked(path: Path) -> Path:
    """`lora_file`, with the OS's refusals of a path (a name too long, a NUL byte, a loop of links, no
    permission) as `LoraError`s naming it."""
    if "\x00" in str(path):
        raise LoraError("LoRA path must not contain a NUL byte")
    try:
        return lora_file(path)
    except (OSError, ValueError, RuntimeError) as exc:
        raise LoraError(f"LoRA path {_shown(path)} cannot be used: {_os_reason(exc)}") from None


def _shown(path: Path) -> str:
    text = str(path)
    return repr(text if len(text) <= 200 else f"{text[:120]}...{text[-60:]}")


def _os_reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__


def lora_file(path: Path) -> Path:
    """The safetensors file `path` names: itself, or the one `.safetensors` file of a folder."""
    if path.is_dir():
        found = sorted(p for p in path.glob(f"*{SUFFIX}") if p.is_file())
        if len(found) == 1:
            return found[0]
        if found:
            raise LoraError(
                f"LoRA folder {path} holds {len(found)} safetensors files ({', '.join(p.name for p in found)}); "
                "name the file"
            )
        others = sorted(p.name for p in path.iterdir() if p.is_file())
        listing = f" (it holds: {', '.join(others[:8])})" if others else " (it is empty)"
        raise LoraError(f"LoRA folder {path} holds no {SUFFIX} file{listing}")
    if not path.exists():
        raise LoraError(f"LoRA file {path} does not exist")
    if not path.is_file():
        raise LoraError(f"LoRA path {path} is neither a file nor a folder")
    if path.suffix != SUFFIX:
        raise LoraError(
            f"LoRA file {path} is not a {SUFFIX} file: only safetensors adapters are supported "
            "(pickle checkpoints such as .bin / .pt / .ckpt are refused; convert them to safetensors)"
        )
    return path


def _check_header(file: Path) -> None:
    """Refuse a file whose safetensors header is cut off, too long, declares too many tensors, is not
    JSON (or nested too deeply to parse), points past the end of the file, or declares a tensor a LoRA
    cannot use (not floating point, or empty)."""
    size = file.stat().st_size
    if size < _HEADER_LENGTH_BYTES:
        raise LoraError(f"LoRA file {file} is not a safetensors file: it has only {size} bytes")
    with file.open("rb") as f:
        header_length = int.from_bytes(f.read(_HEADER_LENGTH_BYTES), "little")
        if header_length > MAX_LORA_HEADER_BYTES:
            raise LoraError(
                f"LoRA file {file} is refused: its safetensors header takes {header_length} bytes, more than the "
                f"{MAX_LORA_HEADER_BYTES // 2**20} MiB a LoRA file may have (MAX_LORA_HEADER_BYTES)"
            )
        if header_length > size - _HEADER_LENGTH_BYTES:
            raise LoraError(
                f"LoRA file {file} is truncated or not a safetensors file: its header needs {header_length} bytes, "
                f"the file has {size - _HEADER_LENGTH_BYTES} after the length field"
            )
        raw = f.read(header_length)
    # Each tensor's entry names "data_offsets" once (inside a JSON string its quotes would be escaped):
    # a count before parsing refuses a header of a million tiny tensors without building it.
    declared = raw.count(b'"data_offsets"')
    if declared > MAX_LORA_TENSORS + 1:  # + 1: a metadata key of that name
        _too_many(file, declared)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"LoRA file {file} is corrupt: its safetensors header is not JSON ({exc})") from exc
    except RecursionError:
        raise LoraError(
            f"LoRA file {file} is corrupt: its safetensors header is JSON nested too deeply"
        ) from None
    if not isinstance(header, dict):
        raise LoraError(f"LoRA file {file} is corrupt: its safetensors header is not a JSON object")
    tensors = len(header) - ("__metadata__" in header)
    if tensors > MAX_LORA_TENSORS:
        _too_many(file, tensors)
    data_bytes = size - _HEADER_LENGTH_BYTES - header_length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise LoraError(f"LoRA file {file} is corrupt: tensor {name!r} has no valid data_offsets")
        if offsets[1] > data_bytes:
            raise LoraError(
                f"LoRA file {file} is truncated: tensor {name!r} ends at byte {offsets[1]} of the data, "
                f"the file holds {data_bytes}"
            )
        _check_entry(file, name, entry)


def _too_many(file: Path, count: int) -> None:
    raise LoraError(
        f"LoRA file {file} is refused: its header declares {count} tensors, more than the {MAX_LORA_TENSORS} a "
        "LoRA file may have (MAX_LORA_TENSORS)"
    )


def _check_entry(file: Path, name: str, entry: dict) -> None:
    """A tensor's dtype and shape, from the header: floating point (an integer `alpha` scalar is the one
    exception: some trainers save it so), and at least one element (a rank-0 pair changes nothing)."""
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise LoraError(f"LoRA file {file} is corrupt: tensor {name!r} has no valid shape")
    elements = math.prod(shape)
    if dtype not in FLOAT_DTYPES and not (name.endswith("alpha") and elements == 1):
        raise LoraError(
            f"LoRA file {file} is unusable: tensor {name!r} has dtype {dtype}; a LoRA's tensors must be "
            f"floating point ({', '.join(sorted(FLOAT_DTYPES))})"
        )
    if elements == 0:
        raise LoraError(
            f"LoRA file {file} is unusable: tensor {name!r} is empty (shape {shape}): a rank-0 adapter "
            "changes nothing"
        )
