"""Diffusers' `AdaLayerNormZero` and `AdaLayerNormContinuous`, on `temb_act` = SiLU(temb) (computed once
per forward); FLUX projects them all in one matmul and calls `modulate_projected`."""

from __future__ import annotations

import torch
from torch import nn

from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm

ADALN_EPS = 1e-6  # every adaLN's in FLUX, SD3 and Qwen-Image


class AdaLayerNormZero(nn.Module):
    """adaLN-Zero of a double-stream block: (shift, scale, gate) for the attention, then for the MLP; it
    modulates the attention input and returns the other vectors for the block to apply."""

    def __init__(self, dim: int, eps: float = ADALN_EPS) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(modulated x, gate_msa, shift_mlp, scale_mlp, gate_mlp) from SiLU(temb)."""
        return self.modulate_projected(x, self.linear(temb_act))

    def modulate_projected(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The same, from `emb` = `linear(temb_act)` (batch, 6 * dim)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = self.modulate(self.norm(x), scale=scale_msa, shift=shift_msa)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormContinuous(nn.Module):
    """The adaLN before a DiT's output projection; its projection is (scale, shift), adaLN-Zero's reversed."""

    def __init__(self, dim: int, eps: float = ADALN_EPS) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        """`x` modulated by SiLU(temb), which is first cast to x's dtype (as Diffusers does)."""
        return self.modulate_projected(x, self.linear(temb_act.to(x.dtype)))

    def modulate_projected(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The same, from `emb` = `linear(temb_act)` (batch, 2 * dim)."""
        scale, shift = emb.chunk(2, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift)
