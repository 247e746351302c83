"""adaLN modulation: `x * (1 + scale) + shift`, with (batch, dim) `scale`/`shift` broadcast over the
sequence of `x` (a batch of 1 over any batch size)."""

from __future__ import annotations

import torch

from diffserve.layers.custom_op import CustomOp


class Modulate(CustomOp):
    """`x * (1 + scale[:, None]) + shift[:, None]`; a natural place for a fused vendor kernel."""

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        # Diffusers' rounding, the shift added in place (a fused addcmul would round differently).
        return (x * (1 + scale.unsqueeze(1))).add_(shift.unsqueeze(1))
