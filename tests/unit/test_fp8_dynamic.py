"""FP8 compute (`--quantization fp8-dynamic`, layers/fp8_dynamic_linear.py) on a machine without it.

The engine refuses it here, naming the device, before anything loads; the layer refuses to bind to such
a device. Its arithmetic is checked through `use_matmul`: the test-only emulation
(`testing/fp8_emulation.py`, dequantize then multiply) gives the same bits as the CPU build of
`torch._scaled_mm` (so it is what that kernel computes), the layer's per-token and per-channel scales
keep the product close to bf16's, and a tiny DiT quantized this way stays close to its bf16 output.
The same layer against bf16 on a real FP8 GPU: tests/gpu/test_fp8_dynamic_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from diffserve import DiffGenerator
from diffserve.configs.memory_options import QUANTIZATION_MODES, check_quantization
from diffserve.errors import UserError
from diffserve.layers.fp8_dynamic_linear import (
    Fp8ComputeUnavailableError,
    Fp8DynamicLinear,
    fp8_dynamic_matmul,
    quantize_activations,
)
from diffserve.layers.gguf_linear import quantized_layer_kinds
from diffserve.layers.quantized_linear import QuantizedLinear
from diffserve.loader.quantize import check_quantization_device, quantize_dit
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.platforms import CpuPlatform
from diffserve.registry import DIT_FACTS
from diffserve.testing.fp8_emulation import emulated_scaled_mm
from diffserve.testing.tiny_writing import random_native_module

FLUX_TINY = {
    "patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 1, "num_single_layers": 2,
    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
    "pooled_projection_dim": 16, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6],
}  # fmt: skip


def _linear(in_features: int, out_features: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features).to(torch.bfloat16)
    with torch.no_grad():  # rows of very different magnitudes: the per-channel scales must follow them
        layer.weight.mul_(torch.logspace(-2, 1, out_features, dtype=torch.bfloat16)[:, None])
    return layer


def _activations(rows: int, width: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Tokens of very different magnitudes: the per-token scales must follow them.
    return (torch.randn(rows, width, generator=g) * torch.logspace(-1, 2, rows)[:, None]).to(torch.bfloat16)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


class _FakeCudaPlatform(CpuPlatform):
    """Claims the CUDA dispatch key (no GPU needed to ask it about FP8)."""

    name = "cuda"
    dispatch_key = "cuda"

    def device_name(self, index: int | None = None) -> str:
        return "Fake GPU"


def test_the_mode_is_declared_beside_the_weight_only_ones() -> None:
    assert QUANTIZATION_MODES == ("int8", "fp8", "fp8-dynamic")
    assert check_quantization("fp8-dynamic") == "fp8-dynamic"


def test_the_engine_refuses_fp8_compute_on_the_cpu_before_loading(tiny_flux_dir) -> None:
    with pytest.raises(UserError) as info:
        DiffGenerator.from_pretrained(
            tiny_flux_dir, device="cpu", show_progress=False, quantization="fp8-dynamic"
        )
    message = str(info.value)
    assert "FP8 compute (--quantization fp8-dynamic) needs an NVIDIA GPU of compute capability 8.9" in message
    assert "(cpu, cpu), which has no FP8 matmul" in message and "--quantization int8 or fp8" in message


def test_old_gpus_and_non_bf16_models_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(UserError, match=r"compute capability 8\.9 or newer; Fake GPU \(cpu\) has 8\.6"):
        check_quantization_device("fp8-dynamic", _FakeCudaPlatform(), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # Hopper, with the probe product running on the CPU's `_scaled_mm`: accepted in bf16 only.
    check_quantization_device("fp8-dynamic", _FakeCudaPlatform(), torch.bfloat16)
    with pytest.raises(UserError, match="--dtype bfloat16"):
        check_quantization_device("fp8-dynamic", _FakeCudaPlatform(), torch.float16)
    check_quantization_device("int8", CpuPlatform(), torch.float32)  # weight-only modes: no device check


def test_the_layer_refuses_to_bind_to_the_cpu_and_to_compute_unbound() -> None:
    layer = Fp8DynamicLinear.from_linear(_linear(64, 48))
    with pytest.raises(Fp8ComputeUnavailableError, match=r"\(cpu, cpu\), which has no FP8 matmul"):
        layer.bind_platform(CpuPlatform())
    with pytest.raises(Fp8ComputeUnavailableError, match="only once bound"):
        layer(_activations(4, 64))


def test_emulation_is_what_scaled_mm_computes() -> None:
    """The test-only emulation and the CPU build of `torch._scaled_mm` agree bit for bit on the layer's
    arguments (per-token and per-channel scales, bias, bf16 output)."""
    layer = Fp8DynamicLinear.from_linear(_linear(64, 48))
    x = _activations(7, 64)
    args = (x, layer.weight, layer.weight_scale, layer.bias)
    assert torch.equal(
        fp8_dynamic_matmul(*args, emulated_scaled_mm), fp8_dynamic_matmul(*args, torch._scaled_mm)
    )


def test_layer_arithmetic_per_token_and_per_channel_scales() -> None:
    linear = _linear(64, 48)
    layer = Fp8DynamicLinear.from_linear(linear)
    layer.use_matmul(emulated_scaled_mm)
    x = _activations(12, 64)
    y = layer(x.view(3, 4, 64))
    assert y.shape == (3, 4, 48) and y.dtype == torch.bfloat16
    # By hand: dequantized e4m3 operands, multiplied in float32.
    x_fp8, x_scale = quantize_activations(x)
    assert torch.equal(x_fp8.float().abs().amax(dim=1), torch.full((12,), 448.0))  # each token fills e4m3
    expected = (x_fp8.float() * x_scale) @ (
        layer.weight.float() * layer.weight_scale[:, None]
    ).T + linear.bias.float()
    assert torch.equal(y.view(12, 48), expected.to(torch.bfloat16))
    # Against the bf16 Linear: e4m3 rounding of both operands, small next to the output everywhere (the
    # rows and tokens span three orders of magnitude each).
    reference = linear(x).float()
    assert _cosine(y.view(12, 48), reference) > 0.998
    per_token = (y.view(12, 48).float() - reference).norm(dim=1) / reference.norm(dim=1)
    assert per_token.max() < 0.08


def test_forward_rows_computes_a_slice_and_zero_tokens_stay_zero() -> None:
    layer = Fp8DynamicLinear.from_linear(_linear(64, 48))
    layer.use_matmul(emulated_scaled_mm)
    x = _activations(5, 64)
    assert torch.equal(layer.forward_rows(x, slice(16, 32)), layer(x)[:, 16:32])
    zero = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(zero), layer.bias.expand(2, -1))


def test_the_layer_refuses_what_fp8_matmuls_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8DynamicLinear.from_linear(_linear(72, 40))
    layer = Fp8DynamicLinear.from_linear(_linear(64, 48))
    layer.use_matmul(emulated_scaled_mm)
    with pytest.raises(TypeError, match="bf16 activations"):
        layer(_activations(2, 64).float())
    with pytest.raises(TypeError, match="keeps its dtypes"):
        layer.to(torch.float32)


def test_quantize_dit_fp8_dynamic_on_a_tiny_flux(caplog) -> None:
    """Every quantizable Linear whose dims FP8 matmuls take becomes an `Fp8DynamicLinear` (the others keep
    their precision, logged), and the DiT's output stays close to bf16's."""
    model = (
        random_native_module(FluxTransformer2DModel, FLUX_TINY, 3, weight_noise=0.05)
        .to(torch.bfloat16)
        .eval()
    )
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 16, 16, generator=g).to(torch.bfloat16),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g).to(torch.bfloat16),
        "pooled_projections": torch.randn(2, 16, generator=g).to(torch.bfloat16),
        "timestep": torch.tensor([0.3, 0.7]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "guidance": torch.tensor([3.5, 3.5]),
    }
    with torch.no_grad():
        reference = model(**inputs)
        model.fuse_for_inference()
        caplog.set_level(logging.INFO, logger="diffserve.loader")
        quantize_dit(model, "fp8-dynamic", "FluxTransformer2DModel", DIT_FACTS)
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert layers and all(isinstance(m, Fp8DynamicLinear) for m in layers)
        assert quantized_layer_kinds(model) == {"fp8-dynamic": len(layers)}
        assert any("fp8-dynamic quantization of" in r.getMessage() for r in caplog.records)
        for layer in layers:
            layer.use_matmul(emulated_scaled_mm)
        quantized = model(**inputs)
    assert _cosine(quantized, reference) > 0.99
