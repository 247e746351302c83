"""The cache methods' decisions (models/cache_methods/) and the batch that runs requests caching differently
(batch.py) on a toy DiT whose blocks are elementwise, so that a row's values do not depend on which rows
share its forward: each row of a mixed batch must equal that request run alone, exactly."""

from __future__ import annotations

import pytest
import torch

from diffserve.configs.cache_settings import (
    DBCacheSettings,
    EasyCacheSettings,
    MagCacheSettings,
    ScmSettings,
    TaylorSeerSettings,
    TeaCacheSettings,
)
from diffserve.errors import InvalidRequestError
from diffserve.models.cache_methods.base import Plan
from diffserve.models.cache_methods.batch import BatchStepCache, CacheRows
from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.cache_methods.dbcache import DBCacheState
from diffserve.models.cache_methods.easycache import EasyCacheState
from diffserve.models.cache_methods.magcache import MagCacheState, resampled
from diffserve.models.cache_methods.registry import new_request_cache
from diffserve.models.cache_methods.taylor import TaylorSeries
from diffserve.models.cache_methods.teacache import TeaCacheState, polynomial

N_BLOCKS = 6


class ToyBlocks:
    """Six elementwise dual-stream blocks over (rows, tokens, dim) streams; the last drops the text (as
    FLUX's). `t` (per row) drives a slow drift between steps, as a denoising schedule does."""

    def __init__(self, x: torch.Tensor, ctx: torch.Tensor, t: torch.Tensor) -> None:
        self.x, self.ctx, self.t = x, ctx, t
        self.calls: list[tuple[list[int] | None, int, int]] = []

    @property
    def num_blocks(self) -> int:
        return N_BLOCKS

    def start(self) -> Streams:
        return Streams(self.x, self.ctx)

    def run(self, streams: Streams, rows: torch.Tensor | None, start: int, stop: int) -> Streams:
        self.calls.append((None if rows is None else rows.tolist(), start, stop))
        t = self.t if rows is None else self.t[rows]
        x, ctx = streams.image, streams.text
        assert ctx is not None
        for i in range(start, stop):
            scale = (1 + 0.1 * i) * (1 + t).view(-1, 1, 1)
            x = torch.tanh(x * scale + ctx.mean(dim=1, keepdim=True) * 0.3)
            ctx = ctx * 0.9 + 0.01 * i
        return Streams(x, None if stop == N_BLOCKS else ctx)

    def whole(self, rows: torch.Tensor | None) -> torch.Tensor:
        x = self.x if rows is None else self.x[rows]
        ctx = self.ctx if rows is None else self.ctx[rows]
        return self.run(Streams(x, ctx), rows, 0, N_BLOCKS).image


def inputs(rows: int, step: int, num_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 5, 4, generator=gen) * (1 - 0.02 * step)
    ctx = torch.randn(rows, 3, 4, generator=gen)
    t = torch.full((rows,), 1 - step / num_steps)
    return x, ctx, t


def run_batch(states, sizes, num_steps: int, rows_seed: list[int] | None = None):
    """Every step of a batch of requests (state, rows); returns each request's outputs per step."""
    outputs: list[list[torch.Tensor]] = [[] for _ in states]
    for step in range(num_steps):
        parts = [inputs(n, step, num_steps) for n in sizes]
        x = torch.cat([p[0] for p in parts])
        ctx = torch.cat([p[1] for p in parts])
        t = torch.cat([p[2] for p in parts])
        blocks = ToyBlocks(x, ctx, t)
        cache = BatchStepCache([CacheRows(s, n, step, num_steps) for s, n in zip(states, sizes, strict=True)])
        signal = x * (1 + t).view(-1, 1, 1)  # a timestep-modulated input
        out = cache.run(x, signal, blocks.whole, lambda blocks=blocks: blocks)
        start = 0
        for i, n in enumerate(sizes):
            outputs[i].append(out[start : start + n])
            start += n
    return outputs


SETTINGS = {
    "dbcache": DBCacheSettings(
        Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.3, max_warmup_steps=2
    ),
    "dbcache+taylorseer": DBCacheSettings(
        Fn_compute_blocks=2,
        residual_diff_threshold=0.5,
        max_warmup_steps=3,
        enable_taylorseer=True,
        enable_encoder_taylorseer=True,
        taylorseer_order=2,
        Bn_compute_blocks=2,
    ),  # fmt: skip
    "teacache": TeaCacheSettings(rel_l1_thresh=0.2),
    "magcache": MagCacheSettings(magcache_thresh=0.2, mag_ratios=(1.0, 1.02, 1.01, 1.0, 0.99)),
    "taylorseer": TaylorSeerSettings(cache_interval=2, disable_cache_before_step=2),
    "scm": ScmSettings(steps_computation_mask=(1, 1, 0, 1, 0, 0, 1, 1)),
    "easycache": EasyCacheSettings(reuse_threshold=0.5, start_percent=0.1),
}


def fresh(name: str):
    return new_request_cache(SETTINGS[name], N_BLOCKS)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_method_reuses_and_counts_steps_and_blocks(name) -> None:
    state = fresh(name)
    run_batch([state], [2], num_steps=8)
    assert state.steps_reused > 0 and state.steps_computed > 0, state.history
    first, last = state.span()
    assert state.blocks_reused == state.steps_reused * (last - first)
    assert state.blocks_computed + state.blocks_reused == 8 * N_BLOCKS
    report = state.report()
    assert report["method"] == name.split("+")[0] and report["settings"]["method"] == report["method"]


def test_a_mixed_batch_gives_every_request_what_it_gets_alone() -> None:
    names = [None, "dbcache", "teacache", "dbcache+taylorseer", "magcache", "taylorseer", "scm", "easycache"]
    sizes = [1, 2, 1, 2, 1, 1, 1, 2]
    together = run_batch([None if n is None else fresh(n) for n in names], sizes, num_steps=8)
    for i, (name, n) in enumerate(zip(names, sizes, strict=True)):
        alone = run_batch([None if name is None else fresh(name)], [n], num_steps=8)[0]
        for step, (a, b) in enumerate(zip(together[i], alone, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} step {step}")


def test_rows_that_reuse_do_not_run_the_middle_blocks() -> None:
    state = DBCacheState(
        DBCacheSettings(
            Fn_compute_blocks=2, Bn_compute_blocks=1, residual_diff_threshold=0.99, max_warmup_steps=1
        ),
        N_BLOCKS,
    )
    x, ctx, t = inputs(3, 0, 4)
    calls = []
    for step in range(3):
        blocks = ToyBlocks(x, ctx, t)  # the same input every step: the Fn residual does not change
        cache = BatchStepCache([CacheRows(None, 1, step, 4), CacheRows(state, 2, step, 4)])
        cache.run(x, x, blocks.whole, lambda blocks=blocks: blocks)
        calls.append(blocks.calls)
    assert calls[0] == [(None, 0, 2), (None, 2, 5), (None, 5, 6)]  # warm-up: every row, in three ranges
    assert calls[1] == [(None, 0, 2), ([0], 2, 5), (None, 5, 6)]  # request 2 reuses blocks 2-4
    assert state.history == [True, False, False]
    assert (state.blocks_computed, state.blocks_reused) == (6 + 3 + 3, 3 + 3)


def test_a_range_method_on_a_dit_that_runs_its_blocks_whole_is_an_error() -> None:
    x, ctx, t = inputs(1, 0, 4)
    cache = BatchStepCache([CacheRows(fresh("dbcache"), 1, 0, 4)])
    with pytest.raises(RuntimeError, match="'dbcache' needs the DiT's blocks in ranges"):
        cache.run(x, x, ToyBlocks(x, ctx, t).whole)


# -- each method's rule -----------------------------------------------------------------------------------


def dbcache_history(settings: DBCacheSettings, changes: list[float], num_steps: int) -> list[bool]:
    """A DBCache request's computed (True) / reused steps when its probe changes by `changes[step]`."""
    state = DBCacheState(settings, N_BLOCKS)
    for step in range(num_steps):
        plan = state.plan(step, num_steps)
        reused = plan is Plan.REUSE or (plan is Plan.MEASURE and state.decide(changes[step], step, num_steps))
        state.keep_probe(torch.zeros(1), reused)
        if not reused:
            state.store(Streams(torch.zeros(1)), step)
        state.record(reused)
    return state.history


def test_dbcache_warms_up_then_reuses_below_the_threshold_within_its_limits() -> None:
    low = [0.01] * 12
    base = {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.1, "max_warmup_steps": 3}
    assert dbcache_history(DBCacheSettings(**base), low, 8) == [True] * 3 + [False] * 5
    assert dbcache_history(DBCacheSettings(**base), [0.2] * 8, 8) == [True] * 8
    capped = DBCacheSettings(**base, max_continuous_cached_steps=2)
    assert dbcache_history(capped, low, 9) == [True] * 3 + [False, False, True] * 2
    assert (
        dbcache_history(DBCacheSettings(**base, max_cached_steps=2), low, 8)
        == [True] * 3 + [False] * 2 + [True] * 3
    )
    interval = DBCacheSettings(**{**base, "max_warmup_steps": 4}, warmup_interval=2)  # warm-up: steps 0 and 2
    assert dbcache_history(interval, low, 6) == [True, False, True, False, False, False]
    accumulated = DBCacheSettings(**base, max_accumulated_residual_diff_threshold=0.025)
    assert dbcache_history(accumulated, low, 8) == [True] * 3 + [False] * 3 + [True] * 2
    assert dbcache_history(DBCacheSettings(**{**base, "residual_diff_threshold": 0}), low, 6) == [True] * 6


def test_dbcache_masks_dynamic_and_static() -> None:
    mask = (1, 1, 0, 0, 1, 0, 0, 1)
    base = {"Fn_compute_blocks": 1, "max_warmup_steps": 8, "steps_computation_mask": mask}
    # The mask's leading computed steps bound the warm-up; dynamic still asks the threshold.
    dynamic = DBCacheSettings(**base, residual_diff_threshold=0.1)
    assert dbcache_history(dynamic, [0.05, 0.05, 0.05, 0.5, 0.05, 0.05, 0.5, 0.05], 8) == [
        True, True, False, True, True, False, True, True,
    ]  # fmt: skip
    static = DBCacheSettings(**base, residual_diff_threshold=0.1, steps_computation_policy="static")
    assert dbcache_history(static, [0.9] * 8, 8) == [bool(m) for m in mask]
    named = DBCacheSettings(
        Fn_compute_blocks=1, steps_computation_mask="fast", steps_computation_policy="static"
    )
    assert dbcache_history(named, [0.9] * 28, 28)[-1] is True


def test_taylor_series_extrapolates_polynomials_exactly() -> None:
    line = TaylorSeries(order=1)
    for step in (0, 2, 4):
        line.update(torch.tensor([3.0 + 2 * step]), step)
    assert line.predict(7).item() == pytest.approx(3 + 2 * 7)
    square = TaylorSeries(order=2)  # backward divided differences at unit spacing
    for step in (0, 1, 2, 3):
        square.update(torch.tensor([float(step**2)]), step)
    assert square.predict(4).item() == pytest.approx(9 + 5 + 2 / 2)  # backward differences: 9, 5, 2
    guarded = TaylorSeries(order=1, first_difference_step=2)  # cache-dit's calibrator: no slope before step 2
    guarded.update(torch.tensor([1.0]), 0)
    guarded.update(torch.tensor([2.0]), 1)
    assert guarded.predict(3).item() == 2.0
    with pytest.raises(RuntimeError, match="before a step computed"):
        TaylorSeries(1).predict(0)


def test_magcache_accumulates_the_ratios_error_as_diffusers_does() -> None:
    ratios = (1.0, 1.0, 1.0, 1.01, 1.01, 1.04, 1.0, 1.0, 1.0, 1.0)
    state = MagCacheState(
        MagCacheSettings(magcache_thresh=0.05, magcache_K=2, retention_ratio=0.2, mag_ratios=ratios), 4
    )
    plans = []
    for step in range(10):
        plan = state.plan(step, 10)
        plans.append(plan)
        if plan is Plan.COMPUTE:
            state.store(Streams(torch.zeros(1)), step)
    # steps 0-1 retained; 2: ratio 1, err 0 -> reuse; 3: ratio 1.01, err .01 -> reuse; 4: 3 steps > K -> compute;
    # 5: 1.04, err .04 -> reuse; 6: ratio 1.04, err .08 -> compute; 7, 8: reuse; 9: past K -> compute.
    assert [p.value for p in plans] == [
        "compute", "compute", "reuse", "reuse", "compute", "reuse", "compute", "reuse", "reuse", "compute",
    ]  # fmt: skip
    assert resampled((1.0, 2.0, 3.0), 5) == [1.0, 1.0, 2.0, 3.0, 3.0]  # nearest, ties to even as torch.round


def test_teacache_rescales_and_accumulates_and_computes_first_and_last() -> None:
    assert polynomial((2.0, 0.0, 1.0), 3.0) == 19.0 and polynomial(None, 0.3) == 0.3
    state = TeaCacheState(TeaCacheSettings(rel_l1_thresh=0.25), 4)
    decisions = []
    for step in range(6):
        plan = state.plan(step, 6)
        reused = plan is Plan.MEASURE and state.decide(0.1, step, 6)
        decisions.append(reused)
        if not reused:
            state.store(Streams(torch.zeros(1)), step)
    assert decisions == [False, True, True, False, True, False]  # 0.1, 0.2 < .25; 0.3 computes and resets


def test_easycache_measures_the_transformation_rate_then_estimates_the_output_change() -> None:
    """Blocks whose output changes by 1 while their input changes by 0.5: k = 2. Each step's estimate is
    k * |input - the last computed input| / |the last computed output|, added up until a step computes."""
    state = EasyCacheState(EasyCacheSettings(reuse_threshold=0.6, start_percent=0.0, end_percent=1.0), 4)
    history = []
    for step in range(7):
        x = torch.full((1, 2, 2), 0.5 * step)  # the blocks' input
        out = torch.full((1, 2, 2), 4.0 + step)  # their output
        plan = state.plan(step, 7)
        change = state.measure(x) if plan is Plan.MEASURE else None
        reused = plan is Plan.MEASURE and state.decide(None if change is None else change.item(), step, 7)
        state.keep_probe(x, reused)
        if not reused:
            state.store(Streams(out - x), step)
        state.record(reused)
        history.append(reused)
        if step == 1:
            assert state.rate is not None and state.rate.item() == pytest.approx(2.0)
    # Steps 0 and 1 compute (k needs two). From step 1 (input 0.5, output 5): 2 * 0.5 / 5 = 0.2 reuses,
    # 0.2 + 2 * 1.0 / 5 = 0.6 computes (k stays 2). From step 3 (input 1.5, output 7): 2 * 0.5 / 7 = 0.14
    # and + 2 * 1.0 / 7 = 0.43 reuse, + 2 * 1.5 / 7 = 0.86 computes.
    assert history == [False, False, True, False, True, True, False]


def test_easycache_warms_up_and_cools_down_and_checks_its_window() -> None:
    state = EasyCacheState(EasyCacheSettings(start_percent=0.25, end_percent=0.75), 4)
    state.rate, state.input_prev = torch.tensor(1.0), torch.zeros(1)
    state.cached.store(Streams(torch.zeros(1)), 0)
    assert [state.plan(step, 8).value for step in range(8)] == ["compute"] * 2 + ["measure"] * 4 + [
        "compute"
    ] * 2
    with pytest.raises(
        InvalidRequestError, match="easycache.start_percent \\(0.5\\) must not exceed end_percent"
    ):
        EasyCacheSettings(start_percent=0.5, end_percent=0.4).check()
