"""The step cache's decisions (models/step_cache.py) and the quality tiers' rules (configs/quality.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from diffserve.configs.quality import (
    ACCEPTED,
    CALIBRATION_FILE,
    CALIBRATION_FORMAT,
    QualityRule,
    canonical_tier,
    check_default_quality,
    read_calibrated_policies,
    write_calibration,
)
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


def test_rows_of_exact_requests_always_run_and_only_computing_rows_are_passed() -> None:
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


POLICIES = {"medium": StepCachePolicy(0.2), "low": StepCachePolicy(0.4), "draft": StepCachePolicy(0.8)}


@pytest.mark.parametrize(
    ("requested", "tier"),
    [
        ("high", "high"),
        ("hd", "high"),  # OpenAI's best image
        ("lossless", "high"),  # diffserve's former name of the exact tier
        ("medium", "medium"),
        ("low", "low"),
        ("draft", "draft"),
        ("auto", "auto"),
        ("standard", "auto"),  # OpenAI's default
    ],
)
def test_every_accepted_quality_names_its_canonical_tier(requested, tier) -> None:
    assert canonical_tier(requested) == tier
    assert set(ACCEPTED) == {"auto", "standard", "high", "hd", "lossless", "medium", "low", "draft"}


@pytest.mark.parametrize(
    ("requested", "default", "tier"),
    [
        (None, "high", "high"),
        (None, "lossless", "high"),  # a default given under the old name still reports the new one
        ("auto", "medium", "medium"),
        ("standard", "low", "low"),
        ("auto", "draft", "draft"),
        ("hd", "medium", "high"),
        ("lossless", "low", "high"),
        ("high", "draft", "high"),
        ("medium", "high", "medium"),
        ("low", "hd", "low"),
        ("draft", "lossless", "draft"),
    ],
)
def test_quality_values_resolve_to_tiers(requested, default, tier) -> None:
    assert QualityRule(default_tier=default, policies=POLICIES).resolve(requested) == tier


def test_the_exact_tier_is_served_without_any_step_cache() -> None:
    rule = QualityRule(family="SomePipeline")
    assert [rule.resolve(value) for value in ("high", "hd", "lossless", "auto", None)] == ["high"] * 5


@pytest.mark.parametrize("value", ["high", "medium", "low", "draft", "lossless", "hd"])
def test_default_quality_accepts_the_tiers_and_names_of_the_exact_one(value) -> None:
    assert check_default_quality(value) == canonical_tier(value)


@pytest.mark.parametrize("value", ["auto", "standard", "ultra", "High"])
def test_default_quality_refuses_anything_else(value) -> None:
    with pytest.raises(
        ValueError, match="default quality must be one of high, medium, low, draft, hd, lossless"
    ):
        check_default_quality(value)
    with pytest.raises(ValueError, match="default quality must be one of"):
        QualityRule(default_tier=value)


def test_unknown_quality_and_missing_tiers_are_400s_naming_quality() -> None:
    rule = QualityRule(policies={"low": StepCachePolicy(0.4)}, family="FluxPipeline")
    with pytest.raises(
        InvalidRequestError,
        match="quality must be one of auto, high, medium, low, draft, hd, lossless, standard",
    ) as err:
        rule.resolve("ultra")
    assert err.value.param == "quality"
    with pytest.raises(
        InvalidRequestError, match="'medium' is not available for FluxPipeline: it has high, low"
    ):
        rule.resolve("medium")


def test_a_policy_under_an_unknown_tier_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown step-cache tiers \['lossless'\]"):
        QualityRule(policies={"lossless": StepCachePolicy(0.1)})


def test_calibration_file_round_trip_and_wrong_family(tmp_path) -> None:
    path = write_calibration(tmp_path, "flux", POLICIES, {"prompts": 3})
    data = json.loads(path.read_text())
    assert data["measurements"] == {"prompts": 3} and data["format"] == CALIBRATION_FORMAT
    assert read_calibrated_policies(tmp_path, "flux") == POLICIES
    assert read_calibrated_policies(tmp_path / "missing", "flux") == {}
    with pytest.raises(ValueError, match="made for family 'flux', this model is 'sd3'"):
        read_calibrated_policies(tmp_path, "sd3")


def test_an_old_calibration_file_is_read_under_the_new_names_with_a_warning(tmp_path, caplog) -> None:
    old = {  # as `diffserve calibrate-cache` wrote it before the OpenAI-aligned names: no "format"
        "family": "flux",
        "tiers": {
            name: StepCachePolicy(t).to_dict() for name, t in [("high", 0.1), ("medium", 0.3), ("low", 0.9)]
        },
        "measurements": {},
    }
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(old))
    with caplog.at_level(logging.WARNING, logger="diffserve.quality"):
        policies = read_calibrated_policies(tmp_path, "flux")
    assert {tier: p.threshold for tier, p in policies.items()} == {"medium": 0.1, "low": 0.3, "draft": 0.9}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "high -> medium, medium -> low, low -> draft" in warnings[0]


def test_old_draft_tier_or_unknown_format_is_an_error(tmp_path) -> None:
    path = tmp_path / CALIBRATION_FILE
    path.write_text(json.dumps({"family": "flux", "tiers": {"draft": StepCachePolicy(0.5).to_dict()}}))
    with pytest.raises(ValueError, match=r"unknown tiers \['draft'\] in a file without a format"):
        read_calibrated_policies(tmp_path, "flux")
    path.write_text(json.dumps({"format": 99, "family": "flux", "tiers": {}}))
    with pytest.raises(ValueError, match="unknown format 99; this diffserve reads format 2"):
        read_calibrated_policies(tmp_path, "flux")
