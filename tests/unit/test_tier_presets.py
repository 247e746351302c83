"""Quality tiers as presets (configs/quality.py, configs/cache_rule.py, configs/tier_candidates.py): a tier
runs a cache method with its settings or the original step cache; presets round-trip through calibration
files (format 3, and format 2's threshold-only entries still run); a preset the DiT cannot run fails at
startup naming the tier; a named step mask without a form for the request's steps is a 400 naming
quality; the response's cache report names the tier; the calibration's candidate ladders."""

from __future__ import annotations

import json

import pytest

from diffserve.configs.cache_rule import BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS, CacheRule, check_tier_steps
from diffserve.configs.cache_settings import (
    DBCacheSettings,
    MagCacheSettings,
    ScmSettings,
    TaylorSeerSettings,
    TeaCacheSettings,
)
from diffserve.configs.quality import (
    CALIBRATION_FILE,
    describe_preset,
    preset_from_dict,
    preset_to_dict,
    read_calibrated_policies,
    write_calibration,
)
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.configs.tier_candidates import (
    MAGCACHE_THRESHOLDS,
    STEP_CACHE_THRESHOLDS,
    magcache_ladders,
    method_ladders,
    step_cache_ladders,
)
from diffserve.errors import InvalidRequestError
from diffserve.models.cache_methods.dbcache import DBCacheState
from diffserve.models.cache_methods.registry import new_tier_cache
from diffserve.models.cache_methods.tier import StepCacheState

PRESETS = [
    StepCachePolicy(threshold=0.3, max_reuse_in_a_row=3),
    DBCacheSettings(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.2, enable_taylorseer=True
    ),
    TeaCacheSettings(rel_l1_thresh=0.6),
    TaylorSeerSettings(taylorseer_order=2, cache_interval=3),
    ScmSettings(steps_computation_mask="fast"),
    ScmSettings(steps_computation_mask=(1, 1, 0, 1)),
    MagCacheSettings(magcache_thresh=0.25, mag_ratios=(1.0, 1.1, 1.05)),
]
RULE = CacheRule(
    family="FluxPipeline",
    methods=WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS,
    num_blocks=6,
    teacache_coefficients=(2.0, 0.0),
    mag_ratios=(1.0, 1.2),
)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: describe_preset(p))
def test_presets_round_trip_through_their_dict_form(preset) -> None:
    values = preset_to_dict(preset)
    assert values["method"] == preset.method
    assert preset_from_dict(json.loads(json.dumps(values))) == preset


def test_describe_names_the_method_and_what_differs_from_its_defaults() -> None:
    assert describe_preset(TeaCacheSettings(rel_l1_thresh=0.6)) == "teacache(rel_l1_thresh=0.6)"
    assert describe_preset(ScmSettings()) == "scm(steps_computation_mask=medium)"
    assert (
        describe_preset(ScmSettings(steps_computation_mask=(1, 1, 0, 1)))
        == "scm(steps_computation_mask=1101)"
    )
    assert describe_preset(StepCachePolicy(0.2)).startswith("stepcache(threshold=0.2, full_first_steps=2")
    ratios = describe_preset(MagCacheSettings(mag_ratios=tuple([1.0] * 20)))
    assert ratios == "magcache(mag_ratios=[20 values])"


def test_a_preset_that_is_not_a_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="a tier's preset must reuse work"):
        preset_from_dict({"method": "none"})
    with pytest.raises(ValueError, match="dbcache has no setting 'threshold'"):
        preset_from_dict({"method": "dbcache", "threshold": 0.1})


def test_a_format_3_file_holds_presets_and_is_read_back(tmp_path) -> None:
    presets = {"medium": PRESETS[1], "low": PRESETS[0], "draft": PRESETS[4]}
    path = write_calibration(tmp_path, "flux", presets, {"prompts": ["a"]})
    data = json.loads(path.read_text())
    assert data["format"] == 3 and data["tiers"]["medium"]["method"] == "dbcache"
    assert data["tiers"]["low"] == {"method": "stepcache", **PRESETS[0].to_dict()}
    assert read_calibrated_policies(tmp_path, "flux") == presets


def test_a_format_2_files_thresholds_still_run_as_the_step_cache(tmp_path) -> None:
    old = {"format": 2, "family": "flux", "tiers": {"low": {"threshold": 0.4}}, "measurements": {}}
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(old))
    assert read_calibrated_policies(tmp_path, "flux") == {"low": StepCachePolicy(threshold=0.4)}


def test_a_file_with_a_bad_preset_is_a_clear_error(tmp_path) -> None:
    bad = {"format": 3, "family": "flux", "tiers": {"low": {"method": "fastcache"}}, "measurements": {}}
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(bad))
    with pytest.raises(
        ValueError, match=r"is not a valid step-cache calibration \(cache: method 'fastcache'"
    ):
        read_calibrated_policies(tmp_path, "flux")
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({**bad, "format": 4}))
    with pytest.raises(ValueError, match="unknown format 4; this diffserve reads format 2 .* and 3"):
        read_calibrated_policies(tmp_path, "flux")


def test_a_preset_is_resolved_for_the_dit_or_refused_naming_the_tier() -> None:
    teacache = RULE.resolve_preset("low", TeaCacheSettings(rel_l1_thresh=0.6))
    assert teacache == TeaCacheSettings(rel_l1_thresh=0.6, coefficients=(2.0, 0.0))  # the family's
    magcache = RULE.resolve_preset("low", MagCacheSettings())
    assert isinstance(magcache, MagCacheSettings) and magcache.mag_ratios == (1.0, 1.2)
    assert RULE.resolve_preset("low", PRESETS[0]) is PRESETS[0]
    whole_span = CacheRule(family="ZPipeline", methods=WHOLE_SPAN_METHODS, num_blocks=3)
    with pytest.raises(
        ValueError,
        match=r"quality 'medium' runs dbcache\(.*\), which ZPipeline's DiT does not run \(its cache methods: easy",
    ):
        whole_span.resolve_preset("medium", PRESETS[1])
    with pytest.raises(ValueError, match="quality 'draft': NoCachePipeline's DiT has no step cache"):
        CacheRule(family="NoCachePipeline").resolve_preset("draft", PRESETS[0])
    with pytest.raises(ValueError, match="quality 'low' runs magcache.*needs mag_ratios"):
        whole_span.resolve_preset("low", MagCacheSettings())


def test_a_named_mask_without_a_form_for_the_steps_is_a_400_naming_quality() -> None:
    check_tier_steps("low", ScmSettings(steps_computation_mask="fast"), 20)
    check_tier_steps("low", PRESETS[0], 5)
    with pytest.raises(
        InvalidRequestError, match="quality 'low' runs scm.*need 4, 6 or at least 8 steps"
    ) as err:
        check_tier_steps("low", ScmSettings(steps_computation_mask="fast"), 5)
    assert err.value.param == "quality"


def test_a_tier_cache_reports_its_tier_method_and_settings() -> None:
    state = new_tier_cache("medium", RULE.resolve_preset("medium", PRESETS[1]), 6)
    assert isinstance(state, DBCacheState)
    report = state.report()
    assert report["quality"] == "medium" and report["method"] == "dbcache"
    assert report["settings"]["residual_diff_threshold"] == 0.2
    step = new_tier_cache("low", PRESETS[0], 6)
    assert isinstance(step, StepCacheState)
    assert step.report()["settings"] == {"method": "stepcache", **PRESETS[0].to_dict()}


def test_the_candidate_ladders_run_from_cautious_to_aggressive() -> None:
    template = StepCachePolicy(threshold=0.0, full_first_steps=1, full_last_steps=3)
    stepcache = step_cache_ladders(template)
    assert [len(ladder.presets) for ladder in stepcache] == [len(STEP_CACHE_THRESHOLDS)] * 3
    first = stepcache[0].presets
    assert all(p.full_last_steps == 3 and p.full_first_steps == 1 for p in first)  # the tier's template
    assert [p.threshold for p in first] == sorted(p.threshold for p in first)
    names = [
        ladder.name
        for ladder in method_ladders({"dbcache", "teacache", "taylorseer", "scm", "magcache", "easycache"})
    ]
    assert names == [
        "dbcache F1B0", "dbcache F1B0 + taylorseer", "teacache", "taylorseer order 1", "taylorseer order 2",
        "scm", "scm + taylorseer", "easycache",
    ]  # fmt: skip
    (dbcache, *_) = method_ladders({"dbcache"})
    assert [p.max_continuous_cached_steps for p in dbcache.presets[-3:]] == [3, 3, 5]
    assert method_ladders({"teacache"})[0].presets[0] == TeaCacheSettings(rel_l1_thresh=0.1)
    assert [ladder.name for ladder in magcache_ladders((1.0, 1.2), True)] == [
        "magcache, measured ratios",
        "magcache, the family's ratios",
    ]
    measured, family = magcache_ladders((1.0, 1.2), True)
    assert measured.presets[0].mag_ratios == (1.0, 1.2) and family.presets[0].mag_ratios is None
    assert len(family.presets) == len(MAGCACHE_THRESHOLDS) + 2
    assert [p.magcache_K for p in family.presets[-3:]] == [4, 6, 10]
    assert magcache_ladders(None, False) == []
