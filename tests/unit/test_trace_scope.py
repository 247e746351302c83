"""Trace-time resolution of the request scope in compiled graphs (`layers/trace_scope.py`).

Inside a scoped call (`runtime/compile.py`'s `ScopedCompiledCall`, or `resolved_for_trace` directly) a
graph resolves the attention backend and whether any row has LoRA when it is traced, guarded: SDPA is
traced as SDPA and a batch without LoRA rows as plain Linears, and another backend, an attention hook or
a LoRA batch gets a graph of its own. Outside one the opaque ops read the scope when the graph runs, as
before (`test_no_process_state.py` covers that). flash_attn needs CUDA, so its kernel is replaced by a
fake whose output says it ran. Graphs are recorded with an `aot_eager`-like backend (no C++ compiler).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import diffserve.layers.attention as attention_mod
from diffserve.layers.attention import (
    AttentionBackend,
    attention,
    attention_backend_scope,
    attention_hook_scope,
)
from diffserve.layers.lora_linear import LayerAdapter, LoraLinear, LoraPiece
from diffserve.layers.lora_rows import AppliedLora, LoraRows, lora_rows_scope
from diffserve.layers.trace_scope import (
    TraceScope,
    resolved_for_trace,
    traced_attention_backend,
    traced_lora_rows,
)
from diffserve.runtime.compile import ScopedCompiledCall, current_trace_scope

FLASH_MARK = 7.0


@pytest.fixture(autouse=True)
def fake_flash_attn(monkeypatch) -> None:
    fake = dataclasses.replace(
        attention_mod.SPECS[AttentionBackend.FLASH_ATTN],
        call_unsupported=lambda q, k, v, mask: None,
        run=lambda q, k, v, mask: torch.full_like(q, FLASH_MARK),
    )
    monkeypatch.setitem(attention_mod.SPECS, AttentionBackend.FLASH_ATTN, fake)


@pytest.fixture
def graphs() -> list[torch.fx.GraphModule]:
    torch._dynamo.reset()
    yield []
    torch._dynamo.reset()


def recording(graphs: list[torch.fx.GraphModule]) -> Callable:
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    return backend


def targets(gm: torch.fx.GraphModule) -> set[str]:
    return {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 6, 2, 8, generator=g) for _ in range(3))  # type: ignore[return-value]


def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attention(q * 1, k, v) + 0


def test_nothing_is_resolved_outside_a_scoped_call() -> None:
    assert traced_attention_backend() is None and traced_lora_rows() is None
    with resolved_for_trace(TraceScope("sdpa", attention_hooked=False, lora_rows=False)):
        assert traced_attention_backend() == "sdpa" and traced_lora_rows() is False
        with resolved_for_trace(TraceScope("flash_attn", attention_hooked=True, lora_rows=True)):
            assert traced_attention_backend() is None and traced_lora_rows() is True  # the hook wins
        assert traced_attention_backend() == "sdpa"  # the enclosing mirror is restored
    assert traced_attention_backend() is None and traced_lora_rows() is None


def test_sdpa_is_traced_as_sdpa_and_another_backend_gets_its_own_graph(graphs) -> None:
    """One graph per backend: SDPA lowered as itself (no opaque op), flash_attn through the op with its
    name; each call runs its own backend, and calling again under either compiles nothing."""
    q, k, v = qkv()
    compiled = ScopedCompiledCall(torch.compile(block, backend=recording(graphs), fullgraph=True), block)
    expected = attention(q, k, v)
    with attention_backend_scope(AttentionBackend.SDPA):
        torch.testing.assert_close(compiled(q, k, v), expected)
    with attention_backend_scope(AttentionBackend.FLASH_ATTN):
        assert torch.all(compiled(q, k, v) == FLASH_MARK)
    assert len(graphs) == 2
    sdpa_graph, flash_graph = (targets(gm) for gm in graphs)
    assert any("scaled_dot_product_attention" in t for t in sdpa_graph)
    assert not any("diffserve.attention" in t for t in sdpa_graph)
    assert any("diffserve.attention" in t for t in flash_graph)
    for backend in (AttentionBackend.SDPA, AttentionBackend.FLASH_ATTN):
        with attention_backend_scope(backend):
            compiled(q, k, v)
    assert len(graphs) == 2, "a backend seen before must reuse its graph"


def test_two_threads_with_different_backends_run_their_own_graphs(graphs) -> None:
    q, k, v = qkv()
    compiled = ScopedCompiledCall(torch.compile(block, backend=recording(graphs), fullgraph=True), block)
    both_inside = threading.Barrier(2, timeout=30)
    seen: dict[AttentionBackend, list[bool]] = {}
    errors: list[BaseException] = []

    def run(backend: AttentionBackend) -> None:
        try:
            with attention_backend_scope(backend):
                both_inside.wait()
                seen[backend] = [bool(torch.all(compiled(q, k, v) == FLASH_MARK)) for _ in range(10)]
        except BaseException as exc:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(b,)) for b in (AttentionBackend.SDPA, AttentionBackend.FLASH_ATTN)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen[AttentionBackend.SDPA] == [False] * 10
    assert seen[AttentionBackend.FLASH_ATTN] == [True] * 10


def test_an_attention_hook_keeps_the_opaque_op_and_runs(graphs) -> None:
    """The CUDA-graph runner's hook must still see every attention call: no direct SDPA under a hook."""
    q, k, v = qkv()
    calls: list[AttentionBackend] = []

    def hook(q, k, v, mask, backend):  # noqa: ANN001, ANN202 - the AttentionHook protocol
        calls.append(backend)
        return torch.zeros_like(q)

    compiled = ScopedCompiledCall(torch.compile(block, backend=recording(graphs), fullgraph=True), block)
    with attention_hook_scope(hook):
        assert torch.all(compiled(q, k, v) == 0)
    assert calls == [AttentionBackend.SDPA]
    assert any("diffserve.attention" in t for t in targets(graphs[0]))


# --------------------------------------------------------------------------------------------- LoRA


def lora_layer() -> LoraLinear:
    g = torch.Generator().manual_seed(1)
    base = nn.Linear(8, 6)
    with torch.no_grad():
        base.weight.copy_(torch.randn(6, 8, generator=g))
        base.bias.copy_(torch.randn(6, generator=g))
    layer = LoraLinear(base)
    down, up = torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g)
    layer.adapters[1] = LayerAdapter(down, (LoraPiece(0, 6, 0, 2, up, 0.5),))
    return layer


def test_a_batch_without_lora_rows_traces_the_base_linear_and_a_lora_batch_the_op(graphs) -> None:
    """Mixed batch (row 0 with the adapter, row 1 without) and a batch without any: each its own graph,
    each equal to eager."""
    layer = lora_layer()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))
    compiled = ScopedCompiledCall(torch.compile(layer, backend=recording(graphs), fullgraph=True), layer)
    mixed = LoraRows.for_rows([[AppliedLora(1, "a", 1.0)], []])
    with torch.inference_mode():
        for rows in (None, mixed):
            with lora_rows_scope(rows):
                torch.testing.assert_close(compiled(x), layer(x))
    assert len(graphs) == 2
    plain, with_lora = (targets(gm) for gm in graphs)
    assert not any("lora_linear" in t for t in plain)
    assert any("lora_linear" in t for t in with_lora)


def test_current_trace_scope_reads_the_request_scope() -> None:
    assert current_trace_scope() == TraceScope("sdpa", attention_hooked=False, lora_rows=False)
    with (
        attention_backend_scope(AttentionBackend.FLASH_ATTN),
        lora_rows_scope(LoraRows.for_rows([[], [AppliedLora(3, "b", 0.7)]])),
    ):
        assert current_trace_scope() == TraceScope("flash_attn", attention_hooked=False, lora_rows=True)
    with lora_rows_scope(LoraRows.for_rows([[], []])):  # a scope whose rows apply nothing
        assert current_trace_scope().lora_rows is False
