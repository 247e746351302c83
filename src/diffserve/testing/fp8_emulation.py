"""A reference for `torch._scaled_mm`'s FP8 product, for tests on machines without FP8 compute.

`emulated_scaled_mm` takes `_scaled_mm`'s arguments as `layers/fp8_dynamic_linear.py` passes them (e4m3
operands, a per-row scale for `a` and a per-column scale for `b`, an optional bias, the output dtype) and
computes the same value by dequantizing both operands to float32 and multiplying: e4m3 values and their
products are exact in float32, so this is the exact result before the output's rounding (the CPU build of
`_scaled_mm` gives the same bits, which the tests check). It lives in `testing/` because the engine never
emulates FP8 compute: `Fp8DynamicLinear` refuses devices without it.
"""

from __future__ import annotations

import torch


def emulated_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) + bias in float32, rounded to `out_dtype` once at the end."""
    product = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)
