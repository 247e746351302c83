"""adaLN modulation: `x * (1 + scale) + shift`, with one (scale, shift) per sample.

DiTs condition every block on the timestep (and pooled text) by projecting it to per-sample scale
and shift vectors that modulate the normalised activations. `scale`/`shift` are (batch, dim) and
broadcast over the sequence dimension of `x` (batch, seq, dim); a batch of 1 broadcasts over any
batch size, which lets a shared conditioning vector serve a whole batch.
"""

from __future__ import annotations

import torch

from diffserve.layers.custom_op import CustomOp


class Modulate(CustomOp):
    """`x * (1 + scale[:, None]) + shift[:, None]`; a natural place for a fused vendor kernel."""

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        # Same rounding as Diffusers' `x * (1 + scale) + shift`; the shift is added in place into the
        # fresh product to save one activation-sized allocation (a fused addcmul would round differently).
        return (x * (1 + scale.unsqueeze(1))).add_(shift.unsqueeze(1))
