"""`layers/attention_reuse.py` and `models/cache_methods/attention_level.py`: how a batch's attention calls
are run or stood in for, row group by row group, and that compiled blocks run eagerly meanwhile."""

from __future__ import annotations

import pytest
import torch

from diffserve.configs.cache_settings import FasterCacheSettings, PabSettings
from diffserve.layers.attention_reuse import ReusableAttention, attention_reuse_scope, reused_attention_output
from diffserve.models.cache_methods.attention_level import (
    AttentionReuseScope,
    FasterCacheState,
    PabState,
    ReuseRows,
)
from diffserve.runtime.compile import ScopedCompiledCall


class Doubling(ReusableAttention):
    """Returns (2x, x + 1) and counts the rows it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_run: list[int] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows_run.append(x.shape[0])
        return 2 * x, x + 1


def pab(skip_range: int = 2) -> PabState:
    return PabState(PabSettings(spatial_attention_block_skip_range=skip_range), num_blocks=1)


def forward(module: Doubling, scope: AttentionReuseScope, x: torch.Tensor):
    with attention_reuse_scope(scope):
        return module(x)


def test_outside_a_scope_the_module_runs_as_itself() -> None:
    module = Doubling()
    out, _ = module(torch.ones(2, 3))
    assert module.rows_run == [2] and torch.equal(out, torch.full((2, 3), 2.0))


def test_a_call_runs_unless_every_row_reuses_and_reused_rows_get_their_own_output() -> None:
    module = Doubling()
    state = pab()
    groups = [ReuseRows(state, 0, 2), ReuseRows(None, 2, 3)]  # a PAB request's 2 rows, an exact request's 1
    first = torch.arange(9.0).reshape(3, 3)
    state.begin_forward(500.0)  # iteration 0: computes
    out, _ = forward(module, AttentionReuseScope(groups), first)
    state.record(False)
    assert module.rows_run == [3] and torch.equal(out, 2 * first)

    state.begin_forward(500.0)  # iteration 1, inside (100, 800): the PAB rows reuse, the exact row runs
    second = first + 100
    out, plus_one = forward(module, AttentionReuseScope(groups), second)
    state.record(False)
    assert module.rows_run == [3, 3]
    assert torch.equal(out[:2], 2 * first[:2]) and torch.equal(out[2:], 2 * second[2:])
    assert torch.equal(plus_one[:2], first[:2] + 1)
    assert state.report()["attention_reused"] == 1 and state.report()["attention_computed"] == 1

    state.begin_forward(500.0)  # iteration 2: computes again (every 2nd)
    forward(module, AttentionReuseScope([ReuseRows(state, 0, 2)]), second[:2])
    state.record(False)
    state.begin_forward(500.0)  # iteration 3, the PAB request alone: the call does not run at all
    out, _ = forward(module, AttentionReuseScope([ReuseRows(state, 0, 2)]), first[:2])
    state.record(False)
    assert module.rows_run == [3, 3, 2] and torch.equal(out, 2 * second[:2])
    assert state.history == [True, False, True, False]


def test_outside_the_timestep_range_or_with_other_shapes_the_call_runs() -> None:
    module, state = Doubling(), pab()
    groups = [ReuseRows(state, 0, 1)]
    for timestep, x in ((500.0, torch.ones(1, 4)), (900.0, torch.ones(1, 4)), (500.0, torch.ones(1, 5))):
        state.begin_forward(timestep)
        forward(module, AttentionReuseScope(groups), x)
        state.record(False)
    # ran: iteration 0 (the first), 1 (at 900: outside (100, 800)), 2 (every 2nd; now width 5)
    state.begin_forward(500.0)  # iteration 3 reuses the width-5 output kept at 2: no run
    forward(module, AttentionReuseScope(groups), torch.ones(1, 5))
    state.record(False)
    state.begin_forward(500.0)  # iteration 4 runs
    forward(module, AttentionReuseScope(groups), torch.ones(1, 5))
    state.begin_forward(500.0)  # iteration 5 would reuse, but its input is 6 wide: it runs
    forward(module, AttentionReuseScope(groups), torch.ones(1, 6))
    assert module.rows_run == [1, 1, 1, 1, 1]


def test_fastercache_extrapolates_from_its_last_two_outputs() -> None:
    module = Doubling()
    state = FasterCacheState(FasterCacheSettings(attention_weight=0.5), num_blocks=1)
    groups = [ReuseRows(state, 0, 1)]
    values = [torch.full((1, 2), float(v)) for v in (1, 3, 7, 0)]
    outs = []
    for x in values:  # iterations 0 (runs: no outputs kept yet), 1 (reuse), 2 (runs), 3 (reuse)
        state.begin_forward(500.0)
        outs.append(forward(module, AttentionReuseScope(groups), x)[0])
        state.record(False)
    assert module.rows_run == [1, 1]
    # iteration 1: the first output counts twice, so t + (t - t) * w = t; iteration 3: from 2 and 14
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(outs[3], torch.full((1, 2), 14 + (14 - 2) * 0.5))


def test_a_block_may_ask_before_projecting() -> None:
    module, state = Doubling(), pab()
    groups = [ReuseRows(state, 0, 1)]
    state.begin_forward(500.0)
    with attention_reuse_scope(AttentionReuseScope(groups)):
        assert reused_attention_output(module) is None  # nothing kept: the block must run the call
        module(torch.ones(1, 2))
    state.begin_forward(500.0)
    with attention_reuse_scope(AttentionReuseScope(groups)):
        stood_in = reused_attention_output(module)
    assert stood_in is not None and torch.equal(stood_in[0], torch.full((1, 2), 2.0))
    assert module.rows_run == [1] and state._calls_reused == 1


def test_compiled_blocks_run_eagerly_while_attention_may_be_reused() -> None:
    def compiled(*args, **kwargs):
        raise AssertionError("a graph cannot skip the attention module inside it")

    call = ScopedCompiledCall(compiled, lambda x: x + 1)
    with attention_reuse_scope(AttentionReuseScope([ReuseRows(pab(), 0, 1)])):
        assert call(1) == 2
    with pytest.raises(AssertionError, match="a graph cannot skip"):
        call(1)
