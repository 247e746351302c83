"""FP8 compute (`--quantization fp8-dynamic`) on a GPU with FP8 tensor cores (compute capability >= 8.9):
`torch._scaled_mm` against the test-only emulation (the same products, rounded once), the layer against
its bf16 Linear, a tiny FLUX DiT quantized this way against its bf16 self, and the engine loading it.
Elsewhere (older GPUs, the CPU) the layer refuses to bind, which tests/unit/test_fp8_dynamic.py checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffserve.layers.custom_op import dispatch_custom_ops
from diffserve.layers.fp8_dynamic_linear import Fp8DynamicLinear, fp8_compute_unavailable_reason
from diffserve.loader.quantize import quantize_dit
from diffserve.platforms import CudaPlatform
from diffserve.registry import DIT_FACTS
from diffserve.testing.fp8_emulation import emulated_scaled_mm
from diffserve.testing.parity import cosine
from diffserve.testing.tiny_dits import FLUX, tiny_dit, tiny_dit_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture
def fp8_platform(device: torch.device) -> CudaPlatform:
    if device.type != "cuda":
        pytest.skip("FP8 compute needs an NVIDIA GPU (tests/unit/test_fp8_dynamic.py checks the refusal)")
    platform = CudaPlatform()
    reason = fp8_compute_unavailable_reason(platform)
    if reason is not None:
        pytest.skip(reason)
    return platform


def test_scaled_mm_matches_the_emulation(fp8_platform: CudaPlatform) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3072, 1024).to("cuda", torch.bfloat16)
    layer = Fp8DynamicLinear.from_linear(linear)
    layer.bind_platform(fp8_platform)
    x = torch.randn(4, 333, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        layer.use_matmul(emulated_scaled_mm)
        emulated = layer(x)
        reference = linear(x)
    # The kernel accumulates in fp32 in its own order: within a bf16 step of the once-rounded product.
    torch.testing.assert_close(got.float(), emulated.float(), rtol=1.6e-2, atol=1e-2)
    assert cosine(got.float().cpu(), reference.float().cpu()) > 0.998


def test_tiny_flux_quantized_fp8_dynamic_stays_close_to_bf16(fp8_platform: CudaPlatform) -> None:
    dit = tiny_dit(FLUX, "cuda", torch.bfloat16)
    inputs = tiny_dit_inputs(FLUX, 2, 12, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        reference = dit(**inputs)
        quantize_dit(dit, "fp8-dynamic", "FluxTransformer2DModel", DIT_FACTS)
        dispatch_custom_ops(dit, fp8_platform)
        assert any(isinstance(m, Fp8DynamicLinear) for m in dit.modules())
        quantized = dit(**inputs)
    assert torch.isfinite(quantized).all()
    assert cosine(quantized.float().cpu(), reference.float().cpu()) > 0.99


def test_engine_loads_and_generates_with_fp8_dynamic(fp8_platform: CudaPlatform, tiny_flux_dir) -> None:
    from diffserve import DiffGenerator

    gen = DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False, quantization="fp8-dynamic")
    dit = gen.pipeline.context.components["transformer"].value
    assert any(isinstance(m, Fp8DynamicLinear) for m in dit.modules())
    out = gen.generate(prompt="a red fox", seed=1, height=64, width=64, num_inference_steps=2)
    assert len(out.images) == 1
