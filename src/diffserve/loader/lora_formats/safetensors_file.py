"""Reading a LoRA adapter file: one `.safetensors` file, or a folder holding exactly one (as Diffusers'
`save_lora_weights` writes `pytorch_lora_weights.safetensors`).

The header is checked before safetensors parses it, so a truncated, corrupt or foreign file is
refused with what is wrong with it (not a parser's internals), and an absurd header length is refused
without reading it. Pickle checkpoints (`.bin`, `.pt`, `.ckpt`) are refused: loading them runs code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from diffserve.errors import LoraError

SUFFIX = ".safetensors"
_HEADER_LENGTH_BYTES = 8
# safetensors' own limit on the JSON header
_MAX_HEADER_BYTES = 100_000_000
_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)


def read_lora_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a LoRA file (on CPU, in the file's dtypes) and its safetensors metadata
    (`__metadata__`, empty when absent). `LoraError` naming the path for a missing, foreign, truncated
    or corrupt file."""
    file = lora_file(path)
    _check_header(file)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118  (safe_open is not a Mapping)
    except _READ_ERRORS as exc:
        raise LoraError(f"cannot read LoRA file {file}: the file is corrupt ({exc})") from exc
    return tensors, dict(metadata)


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
    """Refuse a file whose safetensors header is cut off, absurdly long, not JSON, or points past the
    end of the file."""
    size = file.stat().st_size
    if size < _HEADER_LENGTH_BYTES:
        raise LoraError(f"LoRA file {file} is not a safetensors file: it has only {size} bytes")
    with file.open("rb") as f:
        header_length = int.from_bytes(f.read(_HEADER_LENGTH_BYTES), "little")
        if header_length > _MAX_HEADER_BYTES:
            raise LoraError(
                f"LoRA file {file} is not a safetensors file: its header length field says {header_length} bytes "
                f"(at most {_MAX_HEADER_BYTES} allowed)"
            )
        if header_length > size - _HEADER_LENGTH_BYTES:
            raise LoraError(
                f"LoRA file {file} is truncated or not a safetensors file: its header needs {header_length} bytes, "
                f"the file has {size - _HEADER_LENGTH_BYTES} after the length field"
            )
        raw = f.read(header_length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"LoRA file {file} is corrupt: its safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise LoraError(f"LoRA file {file} is corrupt: its safetensors header is not a JSON object")
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
