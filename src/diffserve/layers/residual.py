"""The gated residual add of adaLN-Zero blocks, and the fp16 clamp of the residual stream."""

from __future__ import annotations

import torch

FP16_MAX = 65504


def gated_residual(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`residual + gate * x`, added in place into the fresh product (same rounding, one buffer less)."""
    return (gate * x).add_(residual)


def fp16_clip(x: torch.Tensor) -> torch.Tensor:
    """Diffusers clamps the residual stream in fp16 so that activation outliers do not become inf."""
    return x.clip(-FP16_MAX, FP16_MAX) if x.dtype == torch.float16 else x
