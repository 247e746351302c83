"""Normalisation layers as `CustomOp`s, with Diffusers' parameter names (`weight`, `bias`).

`forward_native` reproduces Diffusers' numerics exactly so that checkpoints give the same outputs:
RMSNorm accumulates the mean square in fp32 (half-precision inputs would lose the small terms) and
LayerNorm is `torch.nn.functional.layer_norm`, which is what `diffusers.models.normalization.LayerNorm`
resolves to on every torch this project supports. Vendor kernels (fused RMSNorm, fused
LayerNorm + modulation) plug in by overriding `forward_<key>`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.custom_op import CustomOp
from diffserve.platforms import Platform

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class RMSNorm(CustomOp):
    """Root-mean-square norm over the last dimension (Zhang & Sennrich, 2019).

    Diffusers uses two RMSNorms whose half-precision rounding differs, and a model must use the one
    its Diffusers counterpart uses to match it bit for bit:

    - `round_once=False` (default): `diffusers.models.normalization.RMSNorm` (also BFL's reference
      QK-norm). The mean square is taken in fp32 and the input scaled in fp32; the result is rounded
      to the weight's dtype when that is fp16/bf16 *before* the weight multiply, or back to the input
      dtype when there is no weight.
    - `round_once=True`: `torch.nn.RMSNorm` / `F.rms_norm`, which Diffusers' FLUX and Wan attention
      use for QK-norm. Normalisation and weight multiply both run in fp32 and the result is rounded
      once (torch may run a fused kernel).

    In fp32 the two are identical.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        round_once: bool = False,
        platform: Platform | None = None,
    ) -> None:
        super().__init__(platform)
        self.dim = dim
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.round_once = round_once
        # `torch.ones` runs on the meta device when the loader builds the model there; the real
        # values are assigned later by `load_state_dict(..., assign=True)`.
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self.round_once:
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)
        input_dtype = x.dtype
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight is None:
            return x.to(input_dtype)
        if self.weight.dtype in _HALF_DTYPES:
            x = x.to(self.weight.dtype)
        return x * self.weight

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, round_once={self.round_once}"


class LayerNorm(CustomOp):
    """Layer norm over the last dimension; `weight`/`bias` exist only when `elementwise_affine`.

    FLUX's blocks use it without affine parameters (the adaLN modulation supplies scale and shift),
    so a checkpoint has no keys for those norms, exactly as with `torch.nn.LayerNorm(..., False)`.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        platform: Platform | None = None,
    ) -> None:
        super().__init__(platform)
        self.dim = dim
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if elementwise_affine and bias else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
