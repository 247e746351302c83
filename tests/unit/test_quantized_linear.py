"""`QuantizedLinear` (layers/quantized_linear.py): per-channel int8 / FP8 storage, error bounds, each of
its matmul paths against the dequantized reference, pre-quantized weights, and the module's honesty
(its bytes, its type, no silent casts)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffserve.layers.fused_linear import FusedLinear
from diffserve.layers.quantized_linear import (
    INT8_KERNEL_MAX_ROWS,
    QuantizedLinear,
    dequantized_matmul,
    fp8_scaled_matmul,
    int8_kernel_matmul,
    linear_rows,
    quantize_weight,
)
from diffserve.platforms import CpuPlatform

FP8_MAX = 448.0


def _linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():  # rows of very different magnitudes: per-channel scales must follow them
        layer.weight.mul_(torch.logspace(-2, 1, out_features)[:, None])
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_int8_rounds_each_row_to_half_a_step_of_its_own_scale() -> None:
    weight = _linear(64, 48).weight.detach()
    q, scale = quantize_weight(weight, "int8")
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert q.abs().max() == 127  # each row's largest weight lands on the grid's end
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()


def test_fp8_keeps_three_mantissa_bits_per_weight() -> None:
    weight = _linear(64, 48).weight.detach()
    q, scale = quantize_weight(weight, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    dequantized = q.float() * scale[:, None]
    # e4m3 normals round to within 2^-4 relatively; below 2^-6 (subnormals) to half a 2^-9 step.
    bound = torch.maximum(weight.abs() * 2**-4, scale[:, None] * 2**-10)
    assert ((dequantized - weight).abs() <= bound + 1e-7).all()


def test_zero_rows_and_meta_weights() -> None:
    weight = torch.zeros(4, 32)
    q, scale = quantize_weight(weight, "int8")
    assert torch.equal(scale, torch.ones(4)) and not q.any()
    q, scale = quantize_weight(torch.empty(8, 32, device="meta"), "fp8")
    assert q.is_meta and q.dtype == torch.float8_e4m3fn and scale.shape == (8,)
    with pytest.raises(ValueError, match="int4"):
        quantize_weight(weight, "int4")


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_computes_with_its_dequantized_weight(mode: str, dtype: torch.dtype) -> None:
    linear = _linear(64, 48).to(dtype)
    layer = QuantizedLinear.from_linear(linear, mode)
    layer.bind_platform(CpuPlatform())
    x = torch.randn(3, 5, 64, dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 5, 48)
    reference = torch.nn.functional.linear(x.float(), layer.dequantized_weight(), linear.bias.float())
    assert _rel(y, reference) < (1e-6 if dtype == torch.float32 else 1e-2)
    # ... and the quantization error against the full-precision layer is what 8 bits give.
    full = linear.float()(x.float())
    assert _rel(y, full) < (0.01 if mode == "int8" else 0.05)


def test_cpu_int8_kernel_matches_the_dequantized_product_and_is_used_where_it_applies(monkeypatch) -> None:
    layer = QuantizedLinear.from_linear(_linear(64, 48).to(torch.bfloat16), "int8")
    layer.bind_platform(CpuPlatform())
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    fast = int8_kernel_matmul(x, layer.weight, layer.weight_scale, layer.bias)
    slow = dequantized_matmul(x, layer.weight, layer.weight_scale, layer.bias)
    assert _rel(fast, slow) < 1e-2
    calls = []
    monkeypatch.setattr(
        "diffserve.layers.quantized_linear.int8_kernel_matmul", lambda *a: calls.append(a) or fast
    )
    layer(x)  # 6 rows of bf16, in_features 64: the kernel
    layer(x.float())  # fp32: dequantize (the kernel's fp32 path is far slower)
    layer(torch.randn(INT8_KERNEL_MAX_ROWS + 1, 64, dtype=torch.bfloat16))  # too many rows for it
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantizing_a_block_of_rows_at_a_time_gives_the_whole_product(dtype: torch.dtype) -> None:
    """The CPU converts cache-sized blocks of rows (and other devices split giant layers): block by block,
    the product is the one-block product (the same dot products; up to the matmul's rounding)."""
    layer = QuantizedLinear.from_linear(_linear(64, 100).to(dtype), "int8")
    x = torch.randn(2, 9, 64, dtype=dtype)
    args = (layer.weight, layer.weight_scale, layer.bias)
    whole = dequantized_matmul(x, *args, chunk_elements=100 * 64)
    blocks = dequantized_matmul(x, *args, chunk_elements=7 * 64)  # 15 blocks, the last of 2 rows
    assert blocks.shape == whole.shape == (2, 9, 100) and blocks.is_contiguous()
    assert _rel(blocks, whole) < (1e-6 if dtype == torch.float32 else 1e-2)
    no_bias = dequantized_matmul(x, layer.weight, layer.weight_scale, None, chunk_elements=7 * 64)
    assert _rel(no_bias + layer.bias, whole) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_int8_kernel_is_not_given_widths_it_crashes_on() -> None:
    """torch 2.13's `_weight_int8pack_mm` segfaults on bf16 inputs whose width is not a multiple of 16:
    the layer must take the dequantizing path there (a crash here would kill the test process)."""
    layer = QuantizedLinear.from_linear(_linear(72, 32).to(torch.bfloat16), "int8")
    layer.bind_platform(CpuPlatform())
    x = torch.randn(4, 72, dtype=torch.bfloat16)
    assert _rel(layer(x), dequantized_matmul(x, layer.weight, layer.weight_scale, layer.bias)) < 1e-6


def test_fp8_scaled_matmul_arithmetic() -> None:
    """The FP8-GPU path (`torch._scaled_mm`, activations quantized per row) run through the CPU's
    `_scaled_mm`, which takes the same arguments; its error is FP8 activations' on top of the weights'."""
    layer = QuantizedLinear.from_linear(_linear(64, 48).to(torch.bfloat16), "fp8")
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    y = fp8_scaled_matmul(x, layer.weight, layer.weight_scale, layer.bias)
    reference = dequantized_matmul(x.float(), layer.weight, layer.weight_scale, layer.bias.float())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 7, 48)
    error = _rel(y, reference)
    print(f"fp8 W8A8 (_scaled_mm) against fp8 weight-only: relative error {error:.4f}")
    assert error < 0.05


def test_forward_rows_and_linear_rows_compute_a_slice_of_the_output() -> None:
    linear = _linear(32, 96)
    layer = QuantizedLinear.from_linear(linear, "int8")
    x = torch.randn(3, 32)
    rows = slice(32, 80)
    assert torch.allclose(layer.forward_rows(x, rows), layer(x)[..., rows], atol=1e-6)
    assert torch.allclose(linear_rows(layer, x, rows), layer(x)[..., rows], atol=1e-6)
    assert torch.allclose(linear_rows(linear, x, rows), linear(x)[..., rows], atol=1e-6)


def test_from_quantized_takes_per_tensor_or_per_channel_scales() -> None:
    torch.manual_seed(0)
    weight = (torch.randn(16, 32) * 100).to(torch.float8_e4m3fn)
    bias = torch.randn(16)
    per_tensor = QuantizedLinear.from_quantized(weight, torch.tensor(0.01), bias)
    per_channel = QuantizedLinear.from_quantized(weight, torch.full((16, 1), 0.01), bias)
    assert torch.equal(per_tensor.weight_scale, torch.full((16,), 0.01))
    assert torch.equal(per_tensor.dequantized_weight(), weight.float() * 0.01)
    x = torch.randn(4, 32)
    assert torch.equal(per_tensor(x), per_channel(x))
    with pytest.raises(ValueError, match="one per output channel"):
        QuantizedLinear.from_quantized(weight, torch.ones(3), bias)
    with pytest.raises(TypeError, match="quantized weight"):
        QuantizedLinear.from_quantized(weight.float(), torch.ones(16), bias)


def test_module_is_honest_about_type_bytes_and_dtype() -> None:
    fused = FusedLinear(256, ("to_q", "to_k"), (128, 128))
    layer = QuantizedLinear.from_linear(fused, "int8")
    assert not isinstance(layer, nn.Linear)
    assert (layer.in_features, layer.out_features) == (256, 256)
    assert (layer.part_names, layer.part_sizes) == (("to_q", "to_k"), (128, 128))
    assert "weight=int8 per-channel" in repr(layer) and "to_k" in repr(layer)
    held = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    assert held == 256 * 256 + 256 * 4 + 256 * 4  # int8 weight, float32 scales, float32 bias
    assert [p.dtype for p in layer.parameters()] == [torch.float32]  # quantized tensors are buffers
    assert layer.to("cpu") is layer  # moving keeps the storage
    fp8 = QuantizedLinear.from_linear(_linear(32, 16), "fp8")
    with pytest.raises(TypeError, match="keeps its dtypes"):
        fp8.to(torch.bfloat16)


def test_platform_binding_picks_the_cpu_path() -> None:
    layer = QuantizedLinear.from_linear(_linear(32, 16), "int8")
    assert layer.dispatched_method_name == "forward_native"
    layer.bind_platform(CpuPlatform())
    assert layer.dispatched_method_name == "forward_cpu"
    assert layer.mode == "int8" and not layer._fp8_scaled_mm


class _FakeCudaPlatform(CpuPlatform):
    """Claims the CUDA dispatch key (no GPU needed to bind a layer for it)."""

    dispatch_key = "cuda"


def test_fp8_gpu_dispatch_takes_scaled_mm_only_where_it_applies(monkeypatch) -> None:
    """The routing of `forward_cuda`, with the capability query (sm90+) answered yes: FP8 layers of bf16
    inputs and widths that are multiples of 16 run `_scaled_mm` (here the CPU's), others dequantize."""
    monkeypatch.setattr("diffserve.layers.quantized_linear._has_fp8_row_scaled_mm", lambda platform: True)
    layer = QuantizedLinear.from_linear(_linear(64, 48).to(torch.bfloat16), "fp8")
    layer.bind_platform(_FakeCudaPlatform())
    assert layer.dispatched_method_name == "forward_cuda" and layer._fp8_scaled_mm
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    args = (layer.weight, layer.weight_scale, layer.bias)
    assert torch.equal(layer(x), fp8_scaled_matmul(x, *args))
    assert torch.equal(layer.forward_rows(x, slice(16, 32)), fp8_scaled_matmul(x, *(t[16:32] for t in args)))
    assert torch.equal(layer(x.float()), dequantized_matmul(x.float(), *args))  # fp32 inputs
    odd = QuantizedLinear.from_linear(_linear(72, 48).to(torch.bfloat16), "fp8")
    odd.bind_platform(_FakeCudaPlatform())
    y = torch.randn(3, 72, dtype=torch.bfloat16)
    assert torch.equal(odd(y), dequantized_matmul(y, odd.weight, odd.weight_scale, odd.bias))
    int8 = QuantizedLinear.from_linear(_linear(64, 48).to(torch.bfloat16), "int8")
    int8.bind_platform(_FakeCudaPlatform())
    assert not int8._fp8_scaled_mm
