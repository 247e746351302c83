"""A single-file `.safetensors` DiT checkpoint as a `TensorSource`: full-precision files as they are,
pre-quantized FP8 files (plain or scaled, `fp8_scales.py`) dequantized to float32 as each weight is read.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from diffserve.errors import ModelLoadError
from diffserve.loader.single_file_readers.fp8_scales import dequantize_fp8, fp8_layout

_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)
_BYTES_PER_DTYPE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1}


class SafetensorsSource:
    """An open `.safetensors` checkpoint (memory-mapped by safetensors; tensors read one at a time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arch: str | None = None
        try:
            self._file = safe_open(str(path), framework="pt", device="cpu")
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
        self.mode = "FP8 weights dequantized at load" if fp8 else "as stored"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._weights)

    def read(self, name: str) -> torch.Tensor:
        weight = self._get(name)
        scale_name = self._layout.scales.get(name)
        scale = None if scale_name is None else self._get(scale_name)
        return dequantize_fp8(weight, scale, name, str(self.path))

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
