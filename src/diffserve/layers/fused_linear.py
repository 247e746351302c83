"""`FusedLinear`: one Linear standing for several that read the same input, their outputs side by side.

A DiT fuses projections after loading (FLUX's q/k/v, its adaLN projections) for fewer, larger matmuls;
the fused layer remembers its parts' module names (relative to the module that owns it) and output
sizes, so that what is addressed by the parts' Diffusers names (a LoRA trained on `attn.to_k`) finds
its rows of the fused output.
"""

from __future__ import annotations

from torch import nn


class FusedLinear(nn.Linear):
    """A Linear whose output rows are, in order, the outputs of `part_names` (`part_sizes` rows each)."""

    def __init__(
        self, in_features: int, part_names: tuple[str, ...], part_sizes: tuple[int, ...], bias: bool = True
    ) -> None:
        if len(part_names) != len(part_sizes) or not part_names:
            raise ValueError(f"a fused Linear needs one size per part, got {part_names} and {part_sizes}")
        super().__init__(in_features, sum(part_sizes), bias=bias)
        self.part_names = part_names
        self.part_sizes = part_sizes

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={list(zip(self.part_names, self.part_sizes, strict=True))}"
