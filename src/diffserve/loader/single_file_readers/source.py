"""`TensorSource`: one single-file checkpoint as the loader reads it, whatever its format.

A source lists its tensors (names as stored, shapes as the model sees them) and reads one at a time as
a full-precision CPU tensor: GGUF blocks and FP8 weights (times their scales) come back dequantized, so
the loader only converts names and casts to the model's dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TensorSource(Protocol):
    """An open single-file checkpoint (`safetensors_file.SafetensorsSource`, `gguf_file.GgufSource`)."""

    #: What the file holds, for logs and errors (e.g. "GGUF (arch flux): Q8_0 x 120, F32 x 300").
    description: str
    #: How the weights are turned into the model's: "as stored", "dequantized at load".
    mode: str
    #: The architecture the file declares (GGUF's `general.architecture`), None when it has no such field.
    arch: str | None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> logical shape, for every weight tensor (scales and markers left out)."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name`, dequantized if stored quantized, on the CPU in a floating-point dtype."""
        ...

    def stored_bytes(self, name: str) -> int:
        """The bytes `name` occupies in the file (with its scale, if any)."""
        ...

    def close(self) -> None:
        """Release the file (memory maps included)."""
        ...
