"""`--compile` on the CPU: oneDNN's fp32 linear in the compiled graphs, where it beats MKL on this host.

A compiled DiT step on the CPU is mostly matmuls (about 70% of it in the profile of the 36.6M FLUX
benchmark DiT, SDPA about 20%, inductor's fused elementwise kernels the rest), so what compilation can
gain there is bounded by the matmul kernel. Inductor (without `freezing`) and eager torch both run an
fp32 Linear as `addmm`, i.e. MKL's sgemm. oneDNN's fp32 inner product (`torch.ops.mkldnn.
_linear_pointwise`, on the plain weight: no packed copy, no extra memory) runs the same products at
about twice MKL's rate on an AMD EPYC host with AVX-512 (process CPU time, (768, 512) x (512, 3584): 12.4
ms against 28.5 ms; whole compiled DiT forward 1.7x eager instead of 1.04x;
benchmarks/README.md, issue 37). Inductor's own lowering of that op needs the weights frozen into
constants, which costs a graph per block instance and packed copies of every weight (rejected earlier,
benchmarks/measurements/runtime-and-layers.md). So the compiled blocks get a post-grad graph pass
(`OneDnnLinearPass`, a per-compile option, never a process-wide inductor setting) that rewrites each
fp32 CPU matmul by a 2-D weight, `addmm(bias, x, w.T)` or `mm(x, w.T)`, into `diffserve::onednn_linear`,
a thin op calling oneDNN (about 2 us of dispatch over calling it directly).

Whether to is decided per host by `choose_cpu_gemm`: both kernels timed alternately on a DiT-like
shape, in process CPU time (robust on a busy machine), and oneDNN taken only when it is at least
`MIN_GAIN` faster; the decision and its figures are logged. Elsewhere (another host's CPU, CUDA, bf16)
the graphs are inductor's own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

logger = logging.getLogger("diffserve.compile")

__all__ = ["GemmChoice", "OneDnnLinearPass", "choose_cpu_gemm", "onednn_linear_available"]

#: oneDNN is chosen only when its best time is at least this much below MKL's.
MIN_GAIN = 0.10
#: The probe's shape: (rows, in_features, out_features), a DiT-like projection (1 GFLOP, ~10-30 ms).
PROBE_SHAPE = (256, 1024, 2048)
PROBE_ROUNDS = 4

_aten = torch.ops.aten


@dataclass(frozen=True)
class GemmChoice:
    """The fp32 CPU GEMM of the compiled graphs: "onednn" or "mkl" (inductor's `addmm`), with the probe's
    best CPU seconds per kernel (None when not probed) and why."""

    kernel: str
    mkl_s: float | None
    onednn_s: float | None
    reason: str

    def describe(self) -> str:
        if self.mkl_s is None or self.onednn_s is None:
            return f"{self.kernel} ({self.reason})"
        return (
            f"{self.kernel} (probe {PROBE_SHAPE[0]}x{PROBE_SHAPE[1]} @ {PROBE_SHAPE[1]}x{PROBE_SHAPE[2]}, "
            f"CPU time: MKL {self.mkl_s * 1e3:.1f} ms, oneDNN {self.onednn_s * 1e3:.1f} ms; {self.reason})"
        )


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN and its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@torch.library.custom_op("diffserve::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN's fp32 inner product (`OneDnnLinearPass` puts it in graphs)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight.contiguous(), bias, "none", [], "")


@_onednn_linear.register_fake
def _onednn_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _cpu_fp32(node: object, ndim: int | None = None) -> bool:
    """Whether an FX node's value is a float32 CPU tensor (of `ndim` dimensions, when given)."""
    value = getattr(node, "meta", {}).get("val")
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.device.type == "cpu"
        and (ndim is None or value.dim() == ndim)
    )


def _transposed_weight(node: object) -> torch.fx.Node | None:
    """`w` when `node` is `w.T` of a 2-D float32 CPU tensor (`permute(w, [1, 0])` or `t(w)`), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is _aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    if node.target not in (_aten.permute.default, _aten.t.default):
        return None
    weight = node.args[0]
    return weight if isinstance(weight, torch.fx.Node) and _cpu_fp32(weight, ndim=2) else None


class OneDnnLinearPass(CustomGraphPass):
    """Post-grad pass: every float32 CPU `addmm(bias, x, w.T)` (beta = alpha = 1, 1-D bias) and
    `mm(x, w.T)` becomes `diffserve::onednn_linear(x, w, bias)`. Other matmuls (batched, scaled,
    other dtypes or devices) are left to inductor."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (_aten.addmm.default, _aten.mm.default):
                continue
            if node.target is _aten.addmm.default:
                bias, x, transposed = node.args[:3]
                scaled = node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1
                if scaled or not _cpu_fp32(bias, ndim=1):
                    continue
            else:
                bias, (x, transposed) = None, node.args[:2]
            weight = _transposed_weight(transposed)
            if weight is None or not _cpu_fp32(x, ndim=2):
                continue
            with graph.inserting_before(node):
                replacement = graph.call_function(
                    torch.ops.diffserve.onednn_linear.default, (x, weight, bias)
                )
            replacement.meta.update(node.meta)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
        graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        """Inductor's cache key of the pass: this file's contents."""
        return get_hash_for_files((__file__,))


def choose_cpu_gemm(rounds: int = PROBE_ROUNDS) -> GemmChoice:
    """Time MKL's `addmm` and oneDNN's linear alternately on `PROBE_SHAPE` (float32, best of `rounds`
    process-CPU-time samples each) and choose oneDNN when it is at least `MIN_GAIN` faster."""
    if not onednn_linear_available():
        return GemmChoice("mkl", None, None, "this torch build has no oneDNN linear")
    rows, in_features, out_features = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    kernels = {
        "mkl": lambda: torch.addmm(bias, x, weight.t()),
        "onednn": lambda: _onednn_linear(x, weight, bias),
    }
    best = {name: float("inf") for name in kernels}
    with torch.inference_mode():
        for run in kernels.values():
            run()  # first calls: oneDNN creates its primitive, MKL its buffers
        for _ in range(rounds):
            for name, run in kernels.items():
                start = time.process_time()
                run()
                best[name] = min(best[name], time.process_time() - start)
    mkl, onednn = best["mkl"], best["onednn"]
    if onednn <= mkl * (1 - MIN_GAIN):
        return GemmChoice("onednn", mkl, onednn, f"at least {MIN_GAIN:.0%} faster than MKL")
    return GemmChoice("mkl", mkl, onednn, f"oneDNN not {MIN_GAIN:.0%} faster: graphs keep inductor's addmm")
