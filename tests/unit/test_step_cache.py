"""The step cache's decisions (models/step_cache.py) and the quality tiers' rules (configs/quality.py)."""

from __future__ import annotations

import json

import pytest
import torch

from diffserve.configs.quality import QualityRule, read_calibrated_policies, write_calibration
from diffserve.errors import InvalidRequestError
from diffserve.models.step_cache import (
    BatchStepCache,
    CacheRows,
    StepCachePolicy,
    StepCacheState,
    batch_step_cache,
)


class CountingBlocks:
    """Stand-in for a DiT's blocks: out = 2x + 1 per row, remembering which rows each call ran."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.calls: list[list[int] | None] = []

    def __call__(self, rows: torch.Tensor | None) -> torch.Tensor:
        self.calls.append(None if rows is None else rows.tolist())
        x = self.x if rows is None else self.x[rows]
        return 2 * x + 1


def run_steps(states: list[StepCacheState | None], rows: list[int], num_steps: int, drift: float):
    """Run `num_steps` steps whose input drifts by `drift` per step; returns outputs and block calls."""
    outputs, calls = [], []
    total = sum(rows)
    for step in range(num_steps):
        x = torch.ones(total, 4, 3) * (1 + drift * step)
        cache = BatchStepCache([CacheRows(s, n, step, num_steps) for s, n in zip(states, rows, strict=True)])
        blocks = CountingBlocks(x)
        outputs.append(cache.run(x, x, blocks))
        calls.append(blocks.calls)
    return outputs, calls


def test_a_slow_signal_reuses_after_the_first_steps_and_the_last_step_runs_in_full() -> None:
    policy = StepCachePolicy(threshold=0.5, full_first_steps=2, full_last_steps=1, max_reuse_in_a_row=10)
    state = StepCacheState(policy)
    outputs, calls = run_steps([state], [2], num_steps=6, drift=0.01)
    assert state.history == [True, True, False, False, False, True]
    assert (state.steps_computed, state.steps_reused) == (3, 3)
    # A reused step adds the residual of the last full step (2x+1 - x = x+1 at step 1) to the new input.
    x3 = 1 + 0.01 * 3
    expected = x3 + (1 + 0.01 * 1) + 1
    torch.testing.assert_close(outputs[3], torch.full((2, 4, 3), expected))
    assert calls[3] == [] and calls[5] == [None]


def test_threshold_zero_never_reuses_and_max_reuse_in_a_row_forces_full_steps() -> None:
    never = StepCacheState(StepCachePolicy(threshold=0.0))
    run_steps([never], [1], num_steps=8, drift=0.0)
    assert never.steps_reused == 0
    capped = StepCacheState(
        StepCachePolicy(threshold=10.0, full_first_steps=1, full_last_steps=0, max_reuse_in_a_row=2)
    )
    run_steps([capped], [1], num_steps=8, drift=0.0)
    assert capped.history == [True, False, False, True, False, False, True, False]


def test_a_fast_signal_accumulates_past_the_threshold() -> None:
    state = StepCacheState(
        StepCachePolicy(threshold=0.15, full_first_steps=1, full_last_steps=0, max_reuse_in_a_row=10)
    )
    run_steps([state], [1], num_steps=6, drift=0.1)
    # relative changes ~0.09, 0.08, ...: one reuse, then the accumulated change passes 0.15 and a step runs.
    assert state.history == [True, False, True, False, True, False]


def test_rows_of_lossless_requests_always_run_and_only_computing_rows_are_passed() -> None:
    cached = StepCacheState(StepCachePolicy(threshold=1.0, full_first_steps=1, full_last_steps=0))
    outputs, calls = run_steps([None, cached, None], [1, 2, 1], num_steps=3, drift=0.0)
    assert calls[0] == [None]  # every row runs: one call over the whole batch
    assert calls[1] == [[0, 3]] and calls[2] == [[0, 3]]  # the cached request's rows 1-2 reuse
    for out in outputs:
        torch.testing.assert_close(out, torch.full((4, 4, 3), 3.0))


def test_no_cached_request_means_no_step_cache() -> None:
    assert batch_step_cache([CacheRows(None, 2, 0, 4)]) is None
    assert batch_step_cache(
        [CacheRows(None, 2, 0, 4), CacheRows(StepCacheState(StepCachePolicy(0.1)), 1, 0, 4)]
    )


def test_batch_rows_must_match() -> None:
    cache = BatchStepCache([CacheRows(StepCacheState(StepCachePolicy(0.1)), 2, 0, 4)])
    with pytest.raises(ValueError, match="covers 2 rows, the batch has 3"):
        cache.run(torch.zeros(3, 1), torch.zeros(3, 1), lambda rows: torch.zeros(3, 1))


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        StepCachePolicy(threshold=-1)
    with pytest.raises(ValueError):
        StepCachePolicy(threshold=0.1, full_first_steps=0)


POLICIES = {"medium": StepCachePolicy(0.2), "low": StepCachePolicy(0.4)}


@pytest.mark.parametrize(
    ("requested", "default", "tier"),
    [
        (None, "lossless", "lossless"),
        ("auto", "medium", "medium"),
        ("standard", "low", "low"),
        ("hd", "medium", "lossless"),
        ("lossless", "low", "lossless"),
        ("medium", "lossless", "medium"),
    ],
)
def test_quality_values_resolve_to_tiers(requested, default, tier) -> None:
    assert QualityRule(default_tier=default, policies=POLICIES).resolve(requested) == tier


def test_unknown_quality_and_missing_tiers_are_400s_naming_quality() -> None:
    rule = QualityRule(policies=POLICIES, family="FluxPipeline")
    with pytest.raises(
        InvalidRequestError, match="quality must be one of auto, lossless, high, medium, low"
    ) as err:
        rule.resolve("ultra")
    assert err.value.param == "quality"
    with pytest.raises(
        InvalidRequestError, match="'high' is not available for FluxPipeline: it has lossless, medium, low"
    ):
        rule.resolve("high")


def test_calibration_file_round_trip_and_wrong_family(tmp_path) -> None:
    path = write_calibration(tmp_path, "flux", POLICIES, {"prompts": 3})
    assert json.loads(path.read_text())["measurements"] == {"prompts": 3}
    assert read_calibrated_policies(tmp_path, "flux") == POLICIES
    assert read_calibrated_policies(tmp_path / "missing", "flux") == {}
    with pytest.raises(ValueError, match="made for family 'flux', this model is 'sd3'"):
        read_calibrated_policies(tmp_path, "sd3")
