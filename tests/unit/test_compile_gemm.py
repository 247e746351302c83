"""oneDNN fp32 matmuls in `--compile`d graphs on the CPU (`runtime/compile_gemm.py`).

The pass is checked on graphs made with `make_fx` (no C++ compiler needed): which matmuls it rewrites,
which it leaves, and that the rewritten graph computes what the original did. One inductor run (skipped
without a C++ compiler) checks the per-compile option end to end.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from diffserve.runtime.compile_gemm import (
    GemmChoice,
    OneDnnLinearPass,
    choose_cpu_gemm,
    onednn_linear_available,
)

ONEDNN = "diffserve.onednn_linear.default"
needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN")


def call_targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]


def rewritten(fn, *inputs: torch.Tensor) -> torch.fx.GraphModule:  # noqa: ANN001 - any traceable function
    gm = make_fx(fn, decomposition_table=torch._decomp.core_aten_decompositions())(*inputs)
    OneDnnLinearPass()(gm.graph)
    gm.recompile()
    return gm


@needs_onednn
def test_linear_with_and_without_bias_becomes_onednn_and_computes_the_same() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(2, 5, 16, generator=g),
        torch.randn(24, 16, generator=g),
        torch.randn(24, generator=g),
    )

    def two_linears(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b) + F.linear(x, w)

    gm = rewritten(two_linears, x, w, b)
    targets = call_targets(gm)
    assert targets.count(ONEDNN) == 2
    assert not any("addmm" in t or t == "aten.mm.default" for t in targets)
    torch.testing.assert_close(gm(x, w, b), two_linears(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_other_matmuls_are_left_alone() -> None:
    """bf16, a scaled addmm and a batched matmul are not Linears by an fp32 weight."""
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g)

    def others(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        half = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()
        scaled = torch.addmm(b, x, w.t(), beta=0.5)
        batched = torch.bmm(x[None], w.t()[None])[0]
        return half + scaled + batched

    gm = rewritten(others, x, w, b)
    assert ONEDNN not in call_targets(gm)
    torch.testing.assert_close(gm(x, w, b), others(x, w, b))


@needs_onednn
def test_the_probe_chooses_a_kernel_and_says_why() -> None:
    choice = choose_cpu_gemm(rounds=1)
    assert isinstance(choice, GemmChoice) and choice.kernel in ("onednn", "mkl")
    assert choice.mkl_s is not None and choice.onednn_s is not None
    assert "MKL" in choice.describe() and "oneDNN" in choice.describe()


def inductor_cxx() -> str | None:
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        return shutil.which(get_cpp_compiler())
    except InvalidCxxCompiler:
        return None


@needs_onednn
@pytest.mark.skipif(inductor_cxx() is None, reason="inductor needs a C++ compiler on CPU")
def test_inductor_with_the_pass_matches_eager_at_any_batch() -> None:
    """Dynamic shapes: the rewritten graph serves a batch and length it was not traced at."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    compiled = torch.compile(mlp, dynamic=True, options={"post_grad_custom_pre_pass": OneDnnLinearPass()})
    with torch.inference_mode():
        for shape in ((2, 7, 32), (3, 5, 32)):
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-5, atol=1e-5)
