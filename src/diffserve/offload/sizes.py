"""Components' weight sizes read from their files' headers before anything loads (the memory plan's
input): the safetensors JSON header (names, dtypes, shapes), or a GGUF file's tensor table. Sizes are in
the dtype each component loads in, after `--quantization`; the DiT's repeated blocks are listed apart
(what layerwise offload streams)."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from diffserve.errors import ModelLoadError
from diffserve.layers.gguf_linear import GGUF_BLOCKS
from diffserve.loader.model_index import ComponentSpec
from diffserve.loader.safetensors_weights import find_weight_files
from diffserve.loader.single_file_keys.prefix import strip_dit_prefix

#: safetensors dtype names: (bytes per element, floating point).
_SAFETENSORS_DTYPES: dict[str, tuple[int, bool]] = {
    "F64": (8, True), "F32": (4, True), "F16": (2, True), "BF16": (2, True),
    "F8_E4M3": (1, False), "F8_E5M2": (1, False),  # stored 8-bit: kept as published (not up-cast)
    "I64": (8, False), "I32": (4, False), "I16": (2, False), "I8": (1, False), "U8": (1, False),
    "BOOL": (1, False),
}  # fmt: skip
#: A block of one of the model's own block lists: `<list>.<index>.` at the start of a key, as the lists
#: are direct children of the DiT (transformer_blocks.3.attn..., single_transformer_blocks.0..., blocks.12...,
#: layers.5..., double_blocks.7... in original keys); nested lists (a feed-forward's `net.0`) are not blocks.
_BLOCK_KEY = re.compile(r"^([A-Za-z_]+)\.(\d+)\.")
#: Weight-only quantization stores a Linear's weight in one byte per element plus a float32 scale per row.
QUANTIZED_ELEMENT_BYTES = 1
QUANTIZATION_SCALE_BYTES = 4
#: How many blocks a layerwise-offloaded DiT holds on the device at once: the running one and the next,
#: whose copy overlaps the running one's compute.
LAYERWISE_WINDOW_BLOCKS = 2


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint's header: its name, shape and stored element size; `kept_bytes` when
    the loader keeps it as stored, whatever the dtype (a GGUF weight left in its quantized blocks)."""

    name: str
    shape: tuple[int, ...]
    element_bytes: int
    floating: bool
    kept_bytes: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class ComponentSize:
    """A component's weights on the device: in all, and (a DiT's) per repeated block."""

    total_bytes: int
    block_bytes: tuple[int, ...] = ()

    @property
    def non_block_bytes(self) -> int:
        """What stays on the device when the blocks stream (embedders, norms, the final layer)."""
        return self.total_bytes - sum(self.block_bytes)

    @property
    def window_bytes(self) -> int:
        """The blocks a layerwise-offloaded DiT holds on the device at once."""
        return LAYERWISE_WINDOW_BLOCKS * max(self.block_bytes, default=0)


def read_safetensors_header(path: Path) -> list[TensorEntry]:
    """The tensors a safetensors file holds, from its JSON header alone (8-byte length, then JSON)."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the safetensors header of {path}: {exc}") from exc
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype")
        if dtype not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has dtype {dtype!r}, which diffserve cannot size")
        element, floating = _SAFETENSORS_DTYPES[dtype]
        entries.append(TensorEntry(name, tuple(int(d) for d in info["shape"]), element, floating))
    return entries


def read_gguf_tensors(path: Path) -> list[TensorEntry]:
    """The tensors of a GGUF file (the `gguf` package's reader maps the file; nothing is dequantized):
    the 2-D weights in blocks a `GGUFLinear` runs (Q8_0, Q4_K) at their bytes in the file, as the loader
    keeps them (those of the few modules a family keeps in full precision are counted so too: a plan's
    approximation), the others as floats of the model's dtype (dequantized at load)."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ModelLoadError(f"sizing {path} needs the `gguf` package (pip install gguf)") from exc
    reader = GGUFReader(str(path))
    entries = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in t.shape)
        kept = t.tensor_type.name in GGUF_BLOCKS and len(shape) == 2 and t.name.endswith("weight")
        entries.append(TensorEntry(t.name, shape, 4, True, int(t.n_bytes) if kept else None))
    return entries


def _element_bytes(entry: TensorEntry, dtype: torch.dtype) -> int:
    return dtype.itemsize if entry.floating else entry.element_bytes


def _quantized(entry: TensorEntry) -> bool:
    """Whether weight-only quantization stores `entry` in 8 bits: a Linear's 2-D weight (close enough for
    a plan: the families keep a few Linears, embedders and the final layer among them, in full precision)."""
    return entry.floating and len(entry.shape) == 2 and entry.name.endswith(".weight")


def tensor_bytes(entry: TensorEntry, dtype: torch.dtype, quantization: str | None) -> int:
    """Bytes of `entry` loaded in `dtype` (floating tensors) and, with `quantization`, quantized."""
    if entry.kept_bytes is not None:
        return entry.kept_bytes
    if quantization is not None and _quantized(entry):
        return entry.numel * QUANTIZED_ELEMENT_BYTES + entry.shape[0] * QUANTIZATION_SCALE_BYTES
    return entry.numel * _element_bytes(entry, dtype)


def size_of(
    entries: Iterable[TensorEntry], dtype: torch.dtype, quantization: str | None = None
) -> ComponentSize:
    """Total bytes, and per repeated block (keys `<list>.<index>.`) where there are blocks."""
    total = 0
    blocks: dict[tuple[str, int], int] = {}
    for entry in entries:
        n = tensor_bytes(entry, dtype, quantization)
        total += n
        match = _BLOCK_KEY.match(entry.name)
        if match is not None:
            key = (match.group(1), int(match.group(2)))
            blocks[key] = blocks.get(key, 0) + n
    return ComponentSize(total, tuple(blocks[k] for k in sorted(blocks)))


def component_entries(spec: ComponentSpec, weights_file: Path | None = None) -> list[TensorEntry]:
    """The tensors of a component's checkpoint: its folder's safetensors, or for the DiT with
    `--transformer-weights` (`weights_file`) the single file's, what the loader reads (a GGUF or FP8 file
    is kept partly quantized: its bytes, not the folder's full-precision ones); an all-in-one file's
    tensors outside its DiT prefix (other components) are left out."""
    if weights_file is not None and weights_file.is_file():
        entries = (
            read_gguf_tensors(weights_file)
            if weights_file.suffix == ".gguf"
            else read_safetensors_header(weights_file)
        )
        names, _ = strip_dit_prefix(entry.name for entry in entries)
        by_name = {entry.name: entry for entry in entries}
        return [replace(by_name[stored], name=name) for name, stored in names.items()]
    return [entry for file in find_weight_files(spec.path) for entry in read_safetensors_header(file)]
