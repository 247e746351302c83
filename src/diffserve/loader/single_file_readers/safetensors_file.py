"""A single-file `.safetensors` DiT checkpoint as a `TensorSource`: full-precision files as they are;
in pre-quantized FP8 files (plain or scaled, `fp8_scales.py`) the 2-D e4m3 weights stay FP8 with one
scale per row (`read_packed`: the loader makes their Linears weight-only `QuantizedLinear`s), other FP8
tensors (e5m2) are dequantized to float32 as they are read. Tensors are read with `pread` into memory of
their own (`loader/owned_weights.py`), never left as views of the file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError

from diffserve.errors import ModelLoadError
from diffserve.loader.owned_weights import open_safetensors, owned
from diffserve.loader.single_file_readers.fp8_scales import dequantize_fp8, fp8_layout
from diffserve.loader.single_file_readers.source import PackedWeight

_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)
_BYTES_PER_DTYPE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1}


class SafetensorsSource:
    """An open `.safetensors` checkpoint (memory-mapped by safetensors; tensors read one at a time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arch: str | None = None
        try:
            self._file = open_safetensors(path)
            names = list(self._file.keys())
            slices = {name: self._file.get_slice(name) for name in names}
            self._shapes = {name: tuple(s.get_shape()) for name, s in slices.items()}
            self._dtypes = {name: s.get_dtype() for name, s in slices.items()}
        except _READ_ERRORS as exc:
            raise ModelLoadError(f"cannot read {path}: the file is truncated or corrupt ({exc})") from exc
        self._layout = fp8_layout(names, self._get, str(path))
        weights = [
            n for n in names if n not in self._layout.auxiliary and n not in self._layout.scales.values()
        ]
        self._weights = {name: self._shapes[name] for name in weights}
        counts = Counter(self._dtypes[name] for name in weights)
        scaled = len(self._layout.scales)
        self.description = "safetensors: " + ", ".join(f"{dtype} x {n}" for dtype, n in counts.most_common())
        if scaled:
            self.description += f" ({scaled} FP8 weights with scales)"
        fp8 = sum(n for dtype, n in counts.items() if dtype.startswith("F8"))
        self.mode = "dequantized at load" if fp8 else "as stored"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._weights)

    def read(self, name: str) -> torch.Tensor:
        weight = self._get(name)
        scale_name = self._layout.scales.get(name)
        scale = None if scale_name is None else self._get(scale_name)
        return dequantize_fp8(weight, scale, name, str(self.path))

    def packed_kind(self, name: str) -> str | None:
        return "fp8" if self._dtypes[name] == "F8_E4M3" and len(self._shapes[name]) == 2 else None

    def read_packed(self, name: str) -> PackedWeight:
        if self.packed_kind(name) is None:
            raise ValueError(f"{name!r} is not an FP8 e4m3 weight")
        weight = self._get(name)
        rows = weight.shape[0]
        scale_name = self._layout.scales.get(name)
        scale = torch.ones(rows) if scale_name is None else owned(self._get(scale_name), "cpu", torch.float32)
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(rows)
        elif scale.numel() != rows:
            raise ModelLoadError(
                f"{self.path}: the scale of {name!r} has shape {tuple(scale.shape)}; only per-tensor or per-row "
                f"scales of a {tuple(weight.shape)} weight are supported"
            )
        return PackedWeight(
            "fp8", owned(weight, "cpu", weight.dtype), weight.shape[1], scale.reshape(rows).contiguous()
        )

    def quantized_type(self, name: str) -> str | None:
        return self._dtypes[name] if self._dtypes[name].startswith("F8") else None

    def stored_bytes(self, name: str) -> int:
        names = [name] + ([self._layout.scales[name]] if name in self._layout.scales else [])
        total = 0
        for n in names:
            count = 1
            for dim in self._shapes[n]:
                count *= dim
            total += count * _BYTES_PER_DTYPE.get(self._dtypes[n], 4)
        return total

    def close(self) -> None:
        self._file = None

    def _get(self, name: str) -> torch.Tensor:
        try:
            return self._file.get_tensor(name)
        except _READ_ERRORS as exc:
            raise ModelLoadError(f"cannot read tensor {name!r} from {self.path}: {exc}") from exc
