"""`TensorSource`: one single-file checkpoint as the loader reads it, whatever its format.

A source lists its tensors (names as stored, shapes as the model sees them) and reads one at a time as
a full-precision CPU tensor (`read`: GGUF blocks and FP8 weights, times their scales, dequantized), or,
for the weights a quantized layer can run as stored (`packed_kind`: GGUF Q8_0 / Q4_K blocks, FP8 e4m3
weights), as a `PackedWeight` (`read_packed`): the loader keeps those quantized in the model
(`layers/gguf_linear.py::GGUFLinear`, `layers/quantized_linear.py::QuantizedLinear`). Every tensor comes
back in memory of its own, never a view of the file (`loader/owned_weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from diffserve.layers.gguf_linear import GGUFLinear
from diffserve.layers.quantized_linear import QuantizedLinear
from diffserve.loader.single_file_keys.plan import Piece


@dataclass(frozen=True)
class PackedWeight:
    """A Linear's (out, in) weight as a quantized layer keeps it. `kind` "Q8_0" / "Q4_K": `data` the GGUF
    blocks, uint8 (out, bytes per row); "fp8": `data` float8_e4m3fn (out, in) and `scale` its float32
    dequantization factors, one per row (weight = data * scale)."""

    kind: str
    data: torch.Tensor
    in_features: int
    scale: torch.Tensor | None = None

    def take(self, piece: Piece) -> PackedWeight:
        """This weight cut as `piece` cuts its source: a range of rows, halves swapped (rows stay whole,
        so the blocks and the per-row scales cut with them)."""
        return replace(
            self,
            data=piece.take(self.data).contiguous(),
            scale=None if self.scale is None else piece.take(self.scale).contiguous(),
        )

    def with_own_storage(self) -> PackedWeight:
        """This weight with its data and scale each in a storage of its own (copied when a part of a
        larger tensor: a fused file tensor's rows), as offloading needs."""

        def own(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None or tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
                return tensor
            return tensor.clone()

        return replace(self, data=own(self.data), scale=own(self.scale))

    def layer(self, bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        """The quantized layer computing with this weight (and `bias`, already in the compute dtype)."""
        data = self.data.to(device)
        if self.kind == "fp8":
            assert self.scale is not None
            return QuantizedLinear.from_quantized(data, self.scale.to(device), bias)
        return GGUFLinear(data, self.kind, self.in_features, bias)


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

    def packed_kind(self, name: str) -> str | None:
        """The `PackedWeight.kind` tensor `name` can be kept in (a 2-D weight stored Q8_0, Q4_K or FP8
        e4m3), or None: it is read dequantized."""
        ...

    def read_packed(self, name: str) -> PackedWeight:
        """Tensor `name` as stored, for a quantized layer (only where `packed_kind(name)` is not None)."""
        ...

    def quantized_type(self, name: str) -> str | None:
        """The quantized type tensor `name` is stored in ("Q5_K", "F8_E5M2", ...), None for a plain
        floating-point (or integer) one: what `read` dequantizes."""
        ...

    def stored_bytes(self, name: str) -> int:
        """The bytes `name` occupies in the file (with its scale, if any)."""
        ...

    def close(self) -> None:
        """Release the file (memory maps included)."""
        ...
