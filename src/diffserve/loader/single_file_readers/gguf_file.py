"""A `.gguf` DiT checkpoint (city96's layout: the family's original tensor names, quantized blocks
along each weight's rows) as a `TensorSource`, read through the `gguf` package.

Modes: the Linear weights stored Q8_0 or Q4_K stay in their blocks (`packed_kind` / `read_packed`: the
loader makes them `layers/gguf_linear.py::GGUFLinear`s, dequantized per layer as they run, so the DiT
holds about the file's bytes); every other tensor is dequantized at load, one at a time, by gguf-py's
reference dequantizers into float32 (then cast to the model's dtype by the loader). Any type gguf-py
dequantizes loads (F32, F16, BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q2_K..Q6_K, the IQ types); an unknown one
is refused by name before anything is read. ComfyUI-GGUF's `comfy.gguf.orig_shape.<name>` metadata
restores tensors that were reshaped to be quantizable (those are dequantized at load). gguf-py maps the
file; every tensor handed on is a copy, and `close` drops the mapping.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from diffserve.errors import ModelLoadError
from diffserve.layers.gguf_linear import GGUF_BLOCKS
from diffserve.loader.single_file_readers.source import PackedWeight

_ORIG_SHAPE = "comfy.gguf.orig_shape."
_READ_ERRORS = (ValueError, OSError, IndexError, KeyError, TypeError)


def _gguf() -> ModuleType:
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError("reading .gguf checkpoints needs the gguf package: pip install gguf") from exc
    return gguf


class GgufSource:
    """An open `.gguf` file (memory-mapped by gguf-py's reader)."""

    def __init__(self, path: Path) -> None:
        gguf = _gguf()
        self.path = path
        self._gguf = gguf
        try:
            reader = gguf.GGUFReader(str(path))
            self._tensors = {t.name: t for t in reader.tensors}
            self._shapes = {name: self._logical_shape(reader, t) for name, t in self._tensors.items()}
            self._reshaped = {
                name for name in self._tensors if reader.get_field(_ORIG_SHAPE + name) is not None
            }
            arch_field = reader.get_field("general.architecture")
            self.arch: str | None = None if arch_field is None else str(arch_field.contents())
        except _READ_ERRORS as exc:
            raise ModelLoadError(f"cannot read {path}: not a valid GGUF file ({exc})") from exc
        types = Counter(t.tensor_type for t in self._tensors.values())
        for qtype in types:
            self._check_supported(qtype)
        arch = f" (arch {self.arch})" if self.arch else ""
        counts = ", ".join(f"{qtype.name} x {n}" for qtype, n in types.most_common())
        self.description = f"GGUF{arch}: {counts}"
        self.mode = "dequantized at load"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        qtype = tensor.tensor_type
        try:
            if qtype in (self._gguf.GGMLQuantizationType.F32, self._gguf.GGMLQuantizationType.F16):
                array = np.array(tensor.data, copy=True)
            else:
                array = self._gguf.quants.dequantize(tensor.data, qtype)
            array = array.reshape(self._shapes[name])
        except _READ_ERRORS as exc:
            raise ModelLoadError(
                f"cannot read tensor {name!r} ({qtype.name}) from {self.path}: {exc}"
            ) from exc
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(array)

    def packed_kind(self, name: str) -> str | None:
        tensor, shape = self._tensors[name], self._shapes[name]
        kind = tensor.tensor_type.name
        if kind not in GGUF_BLOCKS or len(shape) != 2 or name in self._reshaped:
            return None
        block, block_bytes = GGUF_BLOCKS[kind]
        rows, width = shape
        if width % block or tuple(tensor.data.shape) != (rows, width // block * block_bytes):
            return None
        return kind

    def read_packed(self, name: str) -> PackedWeight:
        kind = self.packed_kind(name)
        if kind is None:
            raise ValueError(f"{name!r} is not stored in blocks a GGUF layer runs")
        try:
            blocks = np.array(self._tensors[name].data, dtype=np.uint8, copy=True)  # off the mapping
        except _READ_ERRORS as exc:
            raise ModelLoadError(f"cannot read tensor {name!r} ({kind}) from {self.path}: {exc}") from exc
        return PackedWeight(kind, torch.from_numpy(blocks), self._shapes[name][1])

    def quantized_type(self, name: str) -> str | None:
        kind = self._tensors[name].tensor_type.name
        return None if kind in ("F32", "F16", "BF16", "F64") else kind

    def stored_bytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def close(self) -> None:
        self._tensors = {}  # the reader's memory map goes with its tensors

    def _logical_shape(self, reader, tensor) -> tuple[int, ...]:
        field = reader.get_field(_ORIG_SHAPE + tensor.name)
        if field is not None:
            return tuple(int(v) for v in field.contents())
        return tuple(int(v) for v in reversed(tensor.shape.tolist()))

    def _check_supported(self, qtype) -> None:
        """Dequantize one zero block of `qtype`: gguf-py raises NotImplementedError for types it lacks."""
        gguf = self._gguf
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return
        type_size = gguf.GGML_QUANT_SIZES[qtype][1]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{self.path}: tensor type {qtype.name} cannot be dequantized by this gguf package version"
            ) from exc
