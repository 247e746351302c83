"""`LoraLinear` and `LoraRows`: per-row adapters in one batch equal each row computed alone with PEFT's
formula, rows without adapters are the base Linear bit for bit, fused layers take their parts' pieces,
a step cache's narrowing keeps each row's adapters, and under torch.compile switching adapters never
recompiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.fused_linear import FusedLinear
from diffserve.layers.lora_linear import LayerAdapter, LoraLinear, LoraPiece
from diffserve.layers.lora_rows import AppliedLora, LoraRows, lora_rows_scope, narrowed_lora_rows

IN, OUT, TOKENS = 12, 10, 5


def _adapter(
    rank: int, seed: int, out: int = OUT, scaling: float = 1.0
) -> tuple[LayerAdapter, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    down, up = torch.randn(rank, IN, generator=g), torch.randn(out, rank, generator=g)
    return LayerAdapter(down, (LoraPiece(0, out, 0, rank, up, scaling),)), down, up


@pytest.fixture
def layer() -> tuple[LoraLinear, nn.Linear, dict[int, tuple[torch.Tensor, torch.Tensor, float]]]:
    torch.manual_seed(0)
    base = nn.Linear(IN, OUT)
    reference = nn.Linear(IN, OUT)
    reference.load_state_dict(base.state_dict())
    wrapped = LoraLinear(base)
    pairs = {}
    for adapter_id, (rank, scaling) in enumerate([(4, 0.5), (2, 2.0)]):
        adapter, down, up = _adapter(rank, 10 + adapter_id, scaling=scaling)
        wrapped.adapters[adapter_id] = adapter
        pairs[adapter_id] = (down, up, scaling)
    return wrapped, reference, pairs


def _expected(reference: nn.Linear, x: torch.Tensor, pairs: dict, loras: list[AppliedLora]) -> torch.Tensor:
    """One row (batch of 1) with PEFT's formula: base, then each adapter's B(A x) * scaling * scale."""
    y = reference(x)
    for lora in sorted(loras, key=lambda lora: lora.adapter_id):
        down, up, scaling = pairs[lora.adapter_id]
        y = y + F.linear(F.linear(x, down), up) * (scaling * lora.scale)
    return y


def _assert_batched_rows_equal_each_alone(
    layer: tuple[LoraLinear, nn.Linear, dict[int, tuple[torch.Tensor, torch.Tensor, float]]],
    row_loras: list[list[AppliedLora]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random inputs, row `i` with the adapters `row_loras[i]`, through the wrapped layer: each
    row must equal `_expected` for that row alone. Returns the inputs and the batched outputs."""
    wrapped, reference, pairs = layer
    x = torch.randn(len(row_loras), TOKENS, IN)
    with torch.no_grad(), lora_rows_scope(LoraRows.for_rows(row_loras)):
        batched = wrapped(x)
    for row, loras in enumerate(row_loras):
        expected = _expected(reference, x[row : row + 1], pairs, loras)
        torch.testing.assert_close(batched[row : row + 1], expected, rtol=1e-5, atol=1e-5)
    return x, batched


def test_mixed_rows_equal_each_row_alone(layer) -> None:
    _, reference, _ = layer
    a, b = AppliedLora(0, "a", 0.8), AppliedLora(1, "b", -0.5)
    row_loras = [[a], [a, b], [], [AppliedLora(0, "a", 1.5)]]
    x, batched = _assert_batched_rows_equal_each_alone(layer, row_loras)
    # The row without adapters is the base Linear, bit for bit.
    assert torch.equal(batched[2], reference(x[2:3])[0])


def test_no_scope_or_empty_scope_is_the_base_layer(layer) -> None:
    wrapped, reference, _ = layer
    x = torch.randn(3, TOKENS, IN)
    with torch.no_grad():
        assert torch.equal(wrapped(x), reference(x))
        with lora_rows_scope(LoraRows.for_rows([[], [], []])):
            assert torch.equal(wrapped(x), reference(x))


def test_uniform_scope_applies_to_any_batch(layer) -> None:
    wrapped, reference, pairs = layer
    loras = [AppliedLora(1, "b", 0.3)]
    x = torch.randn(2, TOKENS, IN)
    with torch.no_grad(), lora_rows_scope(LoraRows.uniform(loras)):
        out = wrapped(x)
    torch.testing.assert_close(out, _expected(reference, x, pairs, loras), rtol=1e-5, atol=1e-5)


def test_wrong_batch_for_the_scope_is_an_error(layer) -> None:
    wrapped, _, _ = layer
    rows = LoraRows.for_rows([[AppliedLora(0, "a", 1.0)]] * 2)
    with torch.no_grad(), lora_rows_scope(rows), pytest.raises(RuntimeError, match="cover a batch of 2"):
        wrapped(torch.randn(3, TOKENS, IN))


def test_scattered_rows_are_gathered_by_scale_and_equal_each_row_alone(layer) -> None:
    """Rows alternating with and without an adapter, at two scales, form more runs than are updated
    slice by slice: the gathered path gives each row its own adapters and scale."""
    _, reference, _ = layer
    scales = [0.5, 2.0]
    row_loras = [[AppliedLora(0, "a", scales[(row // 2) % 2])] if row % 2 == 0 else [] for row in range(12)]
    row_loras[3] = [AppliedLora(1, "b", 1.0)]
    assert len(LoraRows.for_rows(row_loras).uses[0].runs()) > 4
    x, batched = _assert_batched_rows_equal_each_alone(layer, row_loras)
    for row, loras in enumerate(row_loras):
        if not loras:
            assert torch.equal(batched[row], reference(x[row : row + 1])[0])


def test_narrowing_keeps_each_rows_adapters(layer) -> None:
    wrapped, reference, pairs = layer
    a, b = AppliedLora(0, "a", 0.8), AppliedLora(1, "b", 1.0)
    row_loras = [[a], [a], [b], [], [a, b]]
    x = torch.randn(len(row_loras), TOKENS, IN)
    kept_bounds = [(1, 3), (4, 5)]  # rows 1, 2 and 4, as a step cache recomputing two requests runs them
    kept = [1, 2, 4]
    with torch.no_grad(), lora_rows_scope(LoraRows.for_rows(row_loras)), narrowed_lora_rows(kept_bounds):
        out = wrapped(x[kept])
    for position, row in enumerate(kept):
        expected = _expected(reference, x[row : row + 1], pairs, row_loras[row])
        torch.testing.assert_close(out[position : position + 1], expected, rtol=1e-5, atol=1e-5)


def test_fused_layer_pieces_land_on_their_parts_rows() -> None:
    torch.manual_seed(1)
    fused = FusedLinear(IN, ("to_q", "to_k"), (4, 6))
    wrapped = LoraLinear(fused)
    assert wrapped.part_names == ("to_q", "to_k")
    g = torch.Generator().manual_seed(2)
    down_k, up_k = torch.randn(3, IN, generator=g), torch.randn(6, 3, generator=g)
    wrapped.adapters[0] = LayerAdapter(down_k, (LoraPiece(4, 10, 0, 3, up_k, 0.25),))
    x = torch.randn(2, TOKENS, IN)
    with torch.no_grad(), lora_rows_scope(LoraRows.uniform([AppliedLora(0, "k", 2.0)])):
        out = wrapped(x)
    base = F.linear(x, fused.weight, fused.bias)
    assert torch.equal(out[..., :4], base[..., :4])  # to_q's rows untouched
    torch.testing.assert_close(out[..., 4:], base[..., 4:] + F.linear(F.linear(x, down_k), up_k) * 0.5)


def test_wrapping_shares_the_weights_and_keeps_state_dict_names() -> None:
    base = nn.Linear(IN, OUT)
    wrapped = LoraLinear(base)
    assert wrapped.weight is base.weight and wrapped.bias is base.bias
    assert set(wrapped.state_dict()) == {"weight", "bias"}


def test_compiled_layer_switches_adapters_without_recompiling(layer) -> None:
    torch._dynamo.reset()
    wrapped, reference, pairs = layer
    compiled = torch.compile(wrapped, backend="eager", dynamic=True)
    x = torch.randn(3, TOKENS, IN)
    frames = torch._dynamo.utils.counters["stats"]
    before = frames["unique_graphs"]  # a process-wide counter: other tests may have compiled already
    with torch.no_grad():
        outputs = []
        for row_loras in ([[]] * 3, [[AppliedLora(0, "a", 1.0)]] * 3, [[AppliedLora(1, "b", 0.5)], [], []]):
            with lora_rows_scope(LoraRows.for_rows(row_loras)):
                outputs.append((row_loras, compiled(x)))
        compiles = frames["unique_graphs"] - before
        del wrapped.adapters[1]  # unloading an adapter does not recompile either
        with lora_rows_scope(LoraRows.for_rows([[AppliedLora(0, "a", 2.0)]] * 3)):
            compiled(x)
    assert frames["unique_graphs"] - before == compiles == 1
    for row_loras, out in outputs:
        for row, loras in enumerate(row_loras):
            expected = _expected(reference, x[row : row + 1], pairs, loras)
            torch.testing.assert_close(out[row : row + 1], expected, rtol=1e-5, atol=1e-5)


def test_forward_rows_equals_the_same_rows_of_the_whole_output() -> None:
    """A window of the output (FLUX's last block computes only its text rows' k/v) gets the base rows and
    the parts of each adapter's pieces that fall inside it, for uniform and per-row scopes alike."""
    torch.manual_seed(3)
    fused = FusedLinear(IN, ("to_q", "to_k", "to_v"), (4, 4, 4))
    wrapped = LoraLinear(fused)
    g = torch.Generator().manual_seed(4)
    down, up_q, up_k = (
        torch.randn(4, IN, generator=g),
        torch.randn(4, 2, generator=g),
        torch.randn(4, 2, generator=g),
    )
    wrapped.adapters[0] = LayerAdapter(
        down, (LoraPiece(0, 4, 0, 2, up_q, 0.5), LoraPiece(4, 8, 2, 4, up_k, 2.0))
    )
    x = torch.randn(3, TOKENS, IN)
    window = slice(2, 10)  # half of to_q's rows, all of to_k's, half of to_v's
    scopes = [
        LoraRows.uniform([AppliedLora(0, "a", 0.7)]),
        LoraRows.for_rows([[AppliedLora(0, "a", 0.7)], [], []]),  # one run of rows: sliced
        LoraRows.for_rows([[AppliedLora(0, "a", 0.7 + row % 2)] for row in range(6)]),  # many runs: gathered
    ]
    with torch.no_grad():
        for scope in scopes:
            rows = x if scope.num_rows is None else torch.randn(scope.num_rows, TOKENS, IN)
            with lora_rows_scope(scope):
                torch.testing.assert_close(wrapped.forward_rows(rows, window), wrapped(rows)[..., window])
        # No scope: the base layer's rows (a GEMM over fewer output rows: equal up to rounding).
        torch.testing.assert_close(wrapped.forward_rows(x, window), fused(x)[..., window])
