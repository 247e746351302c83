"""Normalisation layers as `CustomOp`s, with Diffusers' parameter names and exact numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.custom_op import CustomOp
from diffserve.platforms import Platform

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class _LastDimNorm(CustomOp):
    """What the norms share: the normalised width `dim` (the last dimension), `eps`, and a `weight` of
    ones (Diffusers' name) only when `elementwise_affine`."""

    def __init__(self, dim: int, eps: float, elementwise_affine: bool, platform: Platform | None) -> None:
        super().__init__(platform)
        self.dim = dim
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(_LastDimNorm):
    """Root-mean-square norm over the last dimension, the mean square in fp32. Diffusers' two RMSNorms
    round differently in half precision, and a model uses its counterpart's: `round_once=False` is
    `diffusers...RMSNorm` (rounds to a fp16/bf16 weight's dtype *before* the weight multiply),
    `round_once=True` is `F.rms_norm` (FLUX's and Wan's QK-norm: one rounding at the end)."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        round_once: bool = False,
        platform: Platform | None = None,
    ) -> None:
        super().__init__(dim, eps, elementwise_affine, platform)
        self.round_once = round_once

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
        return f"{super().extra_repr()}, round_once={self.round_once}"


class LayerNorm(_LastDimNorm):
    """`F.layer_norm` over the last dimension (what Diffusers' LayerNorm resolves to); `weight`/`bias`
    exist only when `elementwise_affine` (adaLN norms have none, as with `torch.nn.LayerNorm(..., False)`)."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        platform: Platform | None = None,
    ) -> None:
        super().__init__(dim, eps, elementwise_affine, platform)
        self.bias = nn.Parameter(torch.zeros(dim)) if elementwise_affine and bias else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
