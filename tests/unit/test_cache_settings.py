"""A request's `cache` (configs/cache_settings.py, cache_rule.py, step_masks.py): the spellings it takes, the
errors it gives (naming the methods, or a method's settings), and what a family allows."""

from __future__ import annotations

import json

import pytest

from diffserve.configs.cache_rule import CacheRule, choose_cache
from diffserve.configs.cache_settings import (
    METHOD_NAMES,
    DBCacheSettings,
    MagCacheSettings,
    NoCache,
    ScmSettings,
    TeaCacheSettings,
    cache_default_from_flag,
    cache_from_flag,
    parse_cache,
)
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_masks import mask_from_runs, named_schedule
from diffserve.errors import InvalidRequestError

DB = {"method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "residual_diff_threshold": 0.12}


@pytest.mark.parametrize(
    "value",
    [
        DB,
        json.dumps(DB),
        "dbcache:Fn_compute_blocks=1,Bn_compute_blocks=0,residual_diff_threshold=0.12",
        " dbcache : Fn_compute_blocks = 1 , residual_diff_threshold=0.12 ",
        DBCacheSettings(Fn_compute_blocks=1, residual_diff_threshold=0.12),
    ],
)
def test_every_spelling_gives_the_same_settings(value) -> None:
    assert parse_cache(value) == DBCacheSettings(Fn_compute_blocks=1, residual_diff_threshold=0.12)


def test_defaults_are_cache_dits_and_lists_become_tuples() -> None:
    db = parse_cache("dbcache")
    assert (db.Fn_compute_blocks, db.Bn_compute_blocks, db.residual_diff_threshold) == (8, 0, 0.08)
    assert (db.max_warmup_steps, db.max_cached_steps, db.max_continuous_cached_steps) == (8, -1, -1)
    mask = parse_cache("dbcache:steps_computation_mask=1101,steps_computation_policy=static")
    assert mask.steps_computation_mask == (1, 1, 0, 1)
    assert parse_cache({"method": "scm", "steps_computation_mask": [1, 0, 1]}).steps_computation_mask == (
        1,
        0,
        1,
    )
    assert parse_cache("teacache:coefficients=1;-2.5;0").coefficients == (1, -2.5, 0)
    assert parse_cache("none") == NoCache()
    assert parse_cache(None) is None
    assert parse_cache("scm").to_dict()["steps_computation_mask"] == "medium"


def test_an_unknown_method_names_the_methods() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_cache({"method": "fbcache"})
    assert info.value.param == "cache"
    assert str(info.value) == (
        "cache: method 'fbcache'; set method to one of none, dbcache, taylorseer, teacache, magcache, scm, "
        "easycache, seacache, pab, fastercache"
    )
    with pytest.raises(InvalidRequestError, match="no method; set method to one of"):
        parse_cache({"Fn_compute_blocks": 1})
    assert METHOD_NAMES == (
        "none", "dbcache", "taylorseer", "teacache", "magcache", "scm", "easycache", "seacache", "pab",
        "fastercache",
    )  # fmt: skip


def test_an_unknown_key_names_that_methods_settings() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_cache({"method": "magcache", "threshold": 0.1})
    assert str(info.value) == (
        "cache: magcache has no setting 'threshold'; its settings: magcache_thresh, magcache_K, "
        "retention_ratio, mag_ratios, magcache_calibrate"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "dbcache", "Fn_compute_blocks": 0}, "dbcache.Fn_compute_blocks must be >= 1, got 0"),
        ({"method": "dbcache", "Fn_compute_blocks": 1.5}, "dbcache.Fn_compute_blocks must be an integer"),
        ({"method": "dbcache", "enable_taylorseer": 1}, "dbcache.enable_taylorseer must be true or false"),
        ({"method": "dbcache", "taylorseer_order": 3}, "dbcache.taylorseer_order must be <= 2, got 3"),
        ({"method": "dbcache", "residual_diff_threshold": float("nan")}, "must be finite"),
        ({"method": "dbcache", "steps_computation_policy": "lazy"}, "must be one of dynamic, static"),
        ({"method": "dbcache", "steps_computation_mask": "fastest"}, "neither a list of 1/0 nor a schedule"),
        ({"method": "scm", "steps_computation_mask": [1, 2]}, "must hold 1 (compute) and 0 (reuse) only"),
        ({"method": "magcache", "retention_ratio": 1.5}, "magcache.retention_ratio must be <= 1"),
        ({"method": "magcache", "mag_ratios": [1.0, -1.0]}, "magcache.mag_ratios must be >= 0"),
        ("dbcache:Fn_compute_blocks", "'Fn_compute_blocks' is not key=value"),
        ("{not json", "not valid JSON"),
        (42, "expected an object"),
    ],
)
def test_bad_values_name_the_setting(value, message) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cache(value)


def test_sampling_params_keep_typed_settings_and_report_them() -> None:
    params = SamplingParams(prompt="a fox", cache=DB)
    assert isinstance(params.cache, DBCacheSettings)
    params.check_values()
    assert params.to_dict()["cache"]["method"] == "dbcache"
    assert params.with_defaults(SamplingParams()).cache == params.cache
    with pytest.raises(InvalidRequestError, match="dbcache has no setting 'Fn'"):
        SamplingParams(prompt="a fox", cache={"method": "dbcache", "Fn": 1})


def test_the_flags_name_themselves_and_the_default_is_kept_as_json() -> None:
    with pytest.raises(InvalidRequestError, match=r"^--cache: method 'x'"):
        cache_from_flag("x:a=1", "--cache")
    text = cache_default_from_flag("dbcache:Fn_compute_blocks=2", "--cache-default")
    assert json.loads(text)["Fn_compute_blocks"] == 2 and parse_cache(text).Fn_compute_blocks == 2
    assert cache_default_from_flag("none", "--cache-default") is None


# -- step masks -------------------------------------------------------------------------------------------


def test_named_schedules_at_28_steps_are_cache_dits() -> None:
    # cache-dit 1.5.3 `steps_mask(total_steps=28, mask_policy=...)` (checked against it when written).
    assert "".join(map(str, named_schedule("slow", 28))) == "1111111101110011100110010001"
    assert sum(named_schedule("medium", 28)) == 15 and sum(named_schedule("fast", 28)) == 11
    assert sum(named_schedule("ultra", 28)) == 8


@pytest.mark.parametrize("steps", [4, 6, 8, 9, 12, 20, 28, 50])
@pytest.mark.parametrize("name", ["slow", "medium", "fast", "ultra"])
def test_named_schedules_fit_any_step_count_and_end_computed(steps, name) -> None:
    mask = named_schedule(name, steps)
    assert len(mask) == steps and mask[-1] == 1 and mask[0] == 1 and set(mask) <= {0, 1}


def test_schedules_need_enough_steps_and_runs_must_cover_them() -> None:
    with pytest.raises(ValueError, match="need 4, 6 or at least 8 steps"):
        named_schedule("fast", 5)
    with pytest.raises(ValueError, match="cover 3 steps, fewer than 4"):
        mask_from_runs([2], [1], 4)


# -- what a family allows ----------------------------------------------------------------------------------

RULE = CacheRule(
    family="FluxPipeline",
    methods=frozenset({"dbcache", "teacache", "magcache", "taylorseer", "scm"}),
    num_blocks=6,
    teacache_coefficients=(1.0, 0.0),
    mag_ratios=(1.0, 1.1),
)


def test_a_method_the_dit_lacks_is_refused_naming_family_and_method() -> None:
    rule = CacheRule(family="SanaPipeline", methods=frozenset({"teacache"}), num_blocks=4)
    with pytest.raises(InvalidRequestError) as info:
        rule.resolve(parse_cache(DB))
    assert info.value.param == "cache"
    assert (
        "cache method 'dbcache' is not supported by SanaPipeline's DiT yet (its cache methods: teacache)"
        in str(info.value)
    )
    with pytest.raises(InvalidRequestError, match="its cache methods: none yet"):
        CacheRule(family="X").resolve(TeaCacheSettings())
    assert CacheRule(family="X").resolve(NoCache()) == NoCache()


def test_dbcache_blocks_must_fit_and_defaults_are_filled_from_the_family() -> None:
    with pytest.raises(
        InvalidRequestError, match=r"Fn_compute_blocks \(8\) \+ Bn_compute_blocks \(0\) exceed"
    ):
        RULE.resolve(DBCacheSettings())
    assert RULE.resolve(DBCacheSettings(Fn_compute_blocks=4, Bn_compute_blocks=2)) is not None
    assert RULE.resolve(TeaCacheSettings()).coefficients == (1.0, 0.0)
    assert RULE.resolve(TeaCacheSettings(coefficients=(2.0,))).coefficients == (2.0,)
    assert RULE.resolve(MagCacheSettings()).mag_ratios == (1.0, 1.1)
    bare = CacheRule(family="SD3Pipeline", methods=frozenset({"magcache"}), num_blocks=4)
    with pytest.raises(InvalidRequestError, match="magcache needs mag_ratios for SD3Pipeline"):
        bare.resolve(MagCacheSettings())
    assert bare.resolve(MagCacheSettings(magcache_calibrate=True)).mag_ratios is None


def test_a_requests_cache_and_the_default_and_quality() -> None:
    scm = ScmSettings()
    assert choose_cache(None, None, "high", RULE, scm) == (scm, "high")  # the default applies
    assert choose_cache(None, "high", "high", RULE, scm) == (None, "high")  # exact asked by name
    assert choose_cache(None, "auto", "medium", RULE, scm) == (None, "medium")  # a default tier wins
    assert choose_cache(NoCache(), None, "high", RULE, scm) == (NoCache(), "high")  # off, over the default
    assert choose_cache(scm, "auto", "medium", RULE, None) == (scm, "high")  # cache over the default tier
    with pytest.raises(InvalidRequestError, match="pass either cache or quality='low'"):
        choose_cache(scm, "low", "low", RULE, None)
