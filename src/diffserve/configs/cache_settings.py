"""A request's `cache`: which cache accelerator it runs, by the name users know, with its typed settings.

Each method is a frozen dataclass whose fields are spelled as cache-dit, SGLang Diffusion and diffusers'
hooks spell them, with cache-dit's defaults, so that a user's settings carry over:

    dbcache     cache-dit's DBCache (`DBCacheConfig`): the first `Fn_compute_blocks` and last
                `Bn_compute_blocks` blocks always run; the middle blocks' residual is reused while the
                first blocks' output residual changes less than `residual_diff_threshold` (relative L1)
                since the last step that ran them; optional TaylorSeer (`enable_taylorseer`) and a steps
                computation mask.
    taylorseer  TaylorSeer (diffusers' `TaylorSeerCacheConfig`): every block runs every `cache_interval`
                steps; in between, the blocks' residual is extrapolated by a Taylor series of
                `taylorseer_order`.
    teacache    TeaCache: the blocks' residual is reused while the accumulated, polynomially rescaled
                relative L1 change of the first block's timestep-modulated input stays below
                `rel_l1_thresh`.
    magcache    MagCache (diffusers' `MagCacheConfig`, SGLang's names): the residual is reused while the
                error accumulated from the model's per-step residual magnitude ratios stays within
                `magcache_thresh`, at most `magcache_K` steps in a row, after the first `retention_ratio`
                of the steps.
    scm         A fixed steps computation mask (cache-dit's SCM): 1 computes a step, 0 reuses.
    easycache   EasyCache: the residual is reused while the output change estimated from each step's input
                change and the blocks' transformation rate (measured between computed steps) stays below
                `reuse_threshold` in sum, between `start_percent` and `end_percent` of the steps.
    seacache    SeaCache (diffusers' `SeaCacheConfig`): the residual is reused (or extrapolated) while the
                accumulated relative L1 change of a spectrally filtered view of the input latents stays
                below `threshold`, between `retention_steps` and `cache_end_steps`.
    pab         Pyramid Attention Broadcast (diffusers' `PyramidAttentionBroadcastConfig`): inside the
                timestep range, each attention module's output is computed every
                `spatial_attention_block_skip_range`-th step (cross-attention's every
                `cross_attention_block_skip_range`-th) and reused in between; every block still runs.
    fastercache FasterCache's attention reuse (diffusers' `FasterCacheConfig`, guidance-distilled form):
                inside the timestep range, each self-attention's output is computed every
                `spatial_attention_block_skip_range`-th step and, in between, extrapolated from its last
                two outputs (`t + (t - t_prev) * attention_weight`).
    none        No cache: the exact path, also when the server has a `--cache-default`.

The accepted spellings (`parse_cache`): a mapping {"method": name, setting: value, ...}, a settings
object, JSON text of such a mapping, or "method:key=value,key=value" (lists as "1;1;0" or, for a mask,
"1110"). Errors name the methods or, for an unknown key, that method's keys; they are InvalidRequestErrors
naming `cache`. What a model supports (its blocks, its methods, its default coefficients) is the family's
check (`configs/cache_rule.py`); the runtime is `models/cache_methods/`. No torch here: the front ends
check a request before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from diffserve.configs.step_masks import SCHEDULE_NAMES
from diffserve.errors import InvalidRequestError

_SETTING = "diffserve.cache_setting"
#: The longest list a setting may hold (a mask or ratios per step, coefficients).
MAX_SETTING_ITEMS = 1000


@dataclass(frozen=True)
class SettingRule:
    """What one setting accepts beyond its type: inclusive bounds, choices, and its help."""

    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None


def setting(
    default: Any,
    *,
    help: str,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A settings field: its default, bounds (for a list: each item's) and help."""
    return field(default=default, metadata={_SETTING: SettingRule(help, min, max, choices)})


def setting_rule(f: dataclasses.Field[Any]) -> SettingRule:
    rule = f.metadata.get(_SETTING)
    assert isinstance(rule, SettingRule), f"{f.name}: declare it with setting(...)"
    return rule


def _fail(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"cache: {message}", param="cache")


@dataclass(frozen=True)
class CacheSettings:
    """Base of the methods' settings: `method` names it; `check()` validates the values (the field types,
    bounds and choices, then the method's own cross-field rules in `check_method`)."""

    method: ClassVar[str]
    #: One line for `--help`, the OpenAPI document and errors.
    summary: ClassVar[str]

    def check(self) -> None:
        """InvalidRequestError (param "cache") naming the setting unless every value is acceptable."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_value(self.method, f.name, getattr(self, f.name), hints[f.name], setting_rule(f))
        self.check_method()

    def check_method(self) -> None:
        """The method's rules across settings (none by default)."""

    def to_dict(self) -> dict[str, Any]:
        """{"method": name, setting: value, ...} with lists as lists: what responses and logs report."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            "method": self.method,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()},
        }

    @classmethod
    def setting_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


@dataclass(frozen=True)
class NoCache(CacheSettings):
    """The exact path, chosen explicitly (it overrides a server's `--cache-default`)."""

    method: ClassVar[str] = "none"
    summary: ClassVar[str] = "no cache: every step runs every block (the exact output)"


def _taylorseer_order() -> Any:
    return setting(
        1, min=1, max=2, help="order of the Taylor series extrapolating the cached residual (1 or 2)"
    )


@dataclass(frozen=True)
class DBCacheSettings(CacheSettings):
    """cache-dit's DBCache (`DBCacheConfig`), with its defaults and TaylorSeer calibrator switches."""

    method: ClassVar[str] = "dbcache"
    summary: ClassVar[str] = (
        "cache-dit's DBCache: the first Fn and last Bn blocks always run, the middle blocks' residual is "
        "reused while the first blocks' output changes less than residual_diff_threshold"
    )

    Fn_compute_blocks: int = setting(8, min=1, help="first blocks run every step; their output decides")
    Bn_compute_blocks: int = setting(0, min=0, help="last blocks run every step, after the reused residual")
    residual_diff_threshold: float = setting(
        0.08, min=0,
        help="reuse while the relative L1 change of the first blocks' output residual since the last "
        "computed step is below this (0: never; 1 or more: always, after warm-up)",
    )  # fmt: skip
    max_warmup_steps: int = setting(8, min=0, help="the first steps (every warmup_interval-th) always run")
    warmup_interval: int = setting(1, min=1, help="within the warm-up, run every n-th step (cache-dit's)")
    max_cached_steps: int = setting(-1, min=-1, help="most steps reused in all (-1: no limit)")
    max_continuous_cached_steps: int = setting(-1, min=-1, help="most steps reused in a row (-1: no limit)")
    max_accumulated_residual_diff_threshold: float | None = setting(
        None, min=0, help="stop reusing once the summed changes of the computed steps pass this (null: off)"
    )
    steps_computation_mask: tuple[int, ...] | str | None = setting(
        None,
        help="1/0 per step (1: compute; 0: may reuse), or a schedule: " + ", ".join(SCHEDULE_NAMES),
    )
    steps_computation_policy: str = setting(
        "dynamic", choices=("dynamic", "static"),
        help="on a mask's 0 steps: 'dynamic' reuses only when the threshold allows, 'static' always",
    )  # fmt: skip
    enable_taylorseer: bool = setting(False, help="extrapolate the reused residual with TaylorSeer")
    enable_encoder_taylorseer: bool = setting(False, help="TaylorSeer for the text stream's residual too")
    taylorseer_order: int = _taylorseer_order()
    enable_separate_cfg: bool | None = setting(
        None,
        help="the CFG branch (negative prompt) keeps its own cache state and decisions (cache-dit's); null: "
        "the model's default, as cache-dit's (true for Qwen-Image, Wan and HunyuanVideo 1.5)",
    )

    def check_method(self) -> None:
        _check_mask(self.steps_computation_mask)


@dataclass(frozen=True)
class TaylorSeerSettings(CacheSettings):
    """TaylorSeer alone, scheduled as diffusers' `TaylorSeerCacheConfig`: compute every `cache_interval`
    steps after `disable_cache_before_step`, extrapolate the residual of every block in between."""

    method: ClassVar[str] = "taylorseer"
    summary: ClassVar[str] = (
        "TaylorSeer: run every block every cache_interval steps, extrapolate the blocks' residual in between"
    )

    taylorseer_order: int = _taylorseer_order()
    cache_interval: int = setting(5, min=1, help="steps between two computed steps, after the warm-up")
    disable_cache_before_step: int = setting(3, min=0, help="the first steps always run (the warm-up)")
    disable_cache_after_step: int | None = setting(None, min=0, help="steps from this one on always run")


@dataclass(frozen=True)
class TeaCacheSettings(CacheSettings):
    """TeaCache: the rescaled change of the first block's timestep-modulated input, accumulated."""

    method: ClassVar[str] = "teacache"
    summary: ClassVar[str] = (
        "TeaCache: reuse the blocks' residual while the accumulated rescaled change of the first block's "
        "timestep-modulated input stays below rel_l1_thresh"
    )

    rel_l1_thresh: float = setting(
        0.25, min=0, help="reuse while the accumulated rescaled relative L1 change is below this"
    )
    coefficients: tuple[float, ...] | None = setting(
        None,
        help="polynomial rescaling the relative L1 change, highest power first (null: the model's TeaCache "
        "coefficients where published, else none: the change itself)",
    )


@dataclass(frozen=True)
class MagCacheSettings(CacheSettings):
    """MagCache: per-step magnitude ratios of the blocks' residual (measured once per model) predict the
    error of reusing it."""

    method: ClassVar[str] = "magcache"
    summary: ClassVar[str] = (
        "MagCache: reuse the residual while the error accumulated from the model's residual magnitude "
        "ratios stays within magcache_thresh"
    )

    magcache_thresh: float = setting(0.06, min=0, help="most accumulated error while reusing")
    magcache_K: int = setting(3, min=0, help="most steps reused in a row")
    retention_ratio: float = setting(0.2, min=0, max=1, help="this share of the first steps always runs")
    mag_ratios: tuple[float, ...] | None = setting(
        None, min=0,
        help="the model's residual magnitude ratio per step (null: the model's recorded ratios, where it has "
        "them); resampled to the request's step count",
    )  # fmt: skip
    magcache_calibrate: bool = setting(
        False, help="never reuse: measure this request's ratios and report them (to pass as mag_ratios)"
    )


@dataclass(frozen=True)
class ScmSettings(CacheSettings):
    """A fixed steps computation mask over the blocks' residual (cache-dit's SCM with the static policy)."""

    method: ClassVar[str] = "scm"
    summary: ClassVar[str] = (
        "a fixed steps computation mask: 1 computes a step, 0 reuses the blocks' residual"
    )

    steps_computation_mask: tuple[int, ...] | str = setting(
        "medium", help="1/0 per step (1: compute; 0: reuse), or a schedule: " + ", ".join(SCHEDULE_NAMES)
    )
    enable_taylorseer: bool = setting(False, help="extrapolate the reused residual with TaylorSeer")
    taylorseer_order: int = _taylorseer_order()

    def check_method(self) -> None:
        _check_mask(self.steps_computation_mask)


@dataclass(frozen=True)
class EasyCacheSettings(CacheSettings):
    """EasyCache (arXiv 2507.02860): runtime-adaptive, no model-specific data. The blocks' transformation
    rate k (output change / input change, measured between computed steps) turns each step's input change
    into an estimated output change; the residual is reused while their sum stays below the threshold.
    Names and defaults as ComfyUI's EasyCache node (diffusers and cache-dit have no EasyCache)."""

    method: ClassVar[str] = "easycache"
    summary: ClassVar[str] = (
        "EasyCache: reuse the blocks' residual while the output change estimated from the input change and "
        "the blocks' measured transformation rate, accumulated, stays below reuse_threshold"
    )

    reuse_threshold: float = setting(
        0.2, min=0, help="reuse while the accumulated estimated relative output change is below this"
    )
    start_percent: float = setting(
        0.15, min=0, max=1, help="this share of the first steps always runs (the warm-up)"
    )
    end_percent: float = setting(0.95, min=0, max=1, help="steps from this share of the steps on always run")

    def check_method(self) -> None:
        if self.start_percent > self.end_percent:
            raise _fail(
                f"easycache.start_percent ({self.start_percent:g}) must not exceed end_percent ({self.end_percent:g})"
            )


@dataclass(frozen=True)
class SeaCacheSettings(CacheSettings):
    """SeaCache (arXiv 2602.18993), as diffusers' `SeaCacheConfig` (names and defaults): each step's input
    latents, filtered by a spectral gain that keeps what the noise level leaves of the clean signal (a
    power prior of exponent `power_exp`), are compared with the previous step's; while the accumulated
    relative L1 change stays below `threshold` the blocks' residual is reused (order 1: extrapolated
    linearly from the last two computed steps)."""

    method: ClassVar[str] = "seacache"
    summary: ClassVar[str] = (
        "SeaCache: reuse the blocks' residual while the accumulated change of the spectrally filtered "
        "input latents stays below threshold"
    )

    threshold: float = setting(
        0.25, min=0, help="reuse while the accumulated relative L1 change is below this"
    )
    residual_order: int = setting(
        1, min=0, max=1, help="0: reuse the last residual; 1: extrapolate from the last two computed steps"
    )
    retention_steps: int = setting(1, min=0, help="the first steps always run")
    cache_end_steps: int = setting(1, min=0, help="the last steps always run")
    max_consecutive_cached: int = setting(2, min=0, help="most steps reused in a row (0: no limit)")
    power_exp: float = setting(3.0, min=0, help="exponent of the clean signal's power prior (> 0)")

    def check_method(self) -> None:
        if self.power_exp <= 0:
            raise _fail(f"seacache.power_exp must be > 0, got {self.power_exp!r}")


def _timestep_range(default: tuple[float, float], what: str) -> Any:
    return setting(
        default,
        help=f"(low, high): {what} only while low < timestep < high (the scheduler's timesteps, 0-1000)",
    )


def within_timesteps(timestep: float, bounds: tuple[float, ...]) -> bool:
    """Whether `timestep` lies strictly inside a `(low, high)` timestep range setting, as diffusers' hooks
    compare their pipeline's current timestep."""
    return bounds[0] < timestep < bounds[1]


def _check_timestep_range(method: str, name: str, value: tuple[float, ...]) -> None:
    if len(value) != 2 or value[0] >= value[1]:
        raise _fail(f"{method}.{name} must be two timesteps (low, high) with low < high, got {list(value)}")


@dataclass(frozen=True)
class PabSettings(CacheSettings):
    """Pyramid Attention Broadcast (arXiv 2408.12588), as diffusers' `PyramidAttentionBroadcastConfig`
    (names and defaults; a skip range left null reuses nothing of that kind). Attention outputs are
    reused, not blocks: the blocks' other layers run every step."""

    method: ClassVar[str] = "pab"
    summary: ClassVar[str] = (
        "Pyramid Attention Broadcast: inside the timestep range, compute each attention's output every "
        "N-th step and reuse it in between"
    )

    spatial_attention_block_skip_range: int | None = setting(
        2, min=1, help="self-attention runs every this many steps inside its timestep range (null: always)"
    )
    spatial_attention_timestep_skip_range: tuple[float, ...] = _timestep_range(
        (100.0, 800.0), "self-attention may be reused"
    )
    cross_attention_block_skip_range: int | None = setting(
        None,
        min=1,
        help="cross-attention runs every this many steps inside its timestep range (null: always)",
    )
    cross_attention_timestep_skip_range: tuple[float, ...] = _timestep_range(
        (100.0, 800.0), "cross-attention may be reused"
    )

    def check_method(self) -> None:
        for name in ("spatial_attention_timestep_skip_range", "cross_attention_timestep_skip_range"):
            _check_timestep_range(self.method, name, getattr(self, name))
        if self.spatial_attention_block_skip_range is None and self.cross_attention_block_skip_range is None:
            raise _fail(
                "pab needs spatial_attention_block_skip_range or cross_attention_block_skip_range "
                "(both null reuse nothing)"
            )


@dataclass(frozen=True)
class FasterCacheSettings(CacheSettings):
    """FasterCache (arXiv 2410.19355), as diffusers' `FasterCacheConfig` (names and defaults;
    `attention_weight` is the constant its default `attention_weight_callback` returns). On a request
    without classifier-free guidance it reuses self-attention alone (diffusers' `is_guidance_distilled`
    form). On a request with CFG it also skips the unconditional (negative-prompt) branch on some steps and
    stands in for that branch's prediction from the prompt branch's, with the frequency-split difference
    of the two kept from the last step that ran both; self-attention is then reused only on those steps."""

    method: ClassVar[str] = "fastercache"
    summary: ClassVar[str] = (
        "FasterCache: inside the timestep range, compute each self-attention every N-th step and "
        "extrapolate it from its last two outputs in between; with CFG, also run the negative-prompt "
        "branch every unconditional_batch_skip_range-th step and approximate it from the prompt branch "
        "in between"
    )

    spatial_attention_block_skip_range: int = setting(
        2, min=1, help="self-attention runs every this many steps inside its timestep range"
    )
    spatial_attention_timestep_skip_range: tuple[float, ...] = _timestep_range(
        (-1.0, 681.0), "self-attention may be extrapolated"
    )
    attention_weight: float = setting(
        0.5, help="an extrapolated output is t + (t - t_prev) * attention_weight (diffusers' default 0.5)"
    )
    unconditional_batch_skip_range: int = setting(
        5, min=1, help="with CFG: the negative-prompt branch runs every this many steps inside its range"
    )
    unconditional_batch_timestep_skip_range: tuple[float, ...] = _timestep_range(
        (-1.0, 641.0), "with CFG, the negative-prompt branch may be approximated"
    )
    low_frequency_weight_update_timestep_range: tuple[float, ...] = _timestep_range(
        (99.0, 901.0), "the low-frequency difference is scaled by alpha_low_frequency at each skipped step"
    )
    high_frequency_weight_update_timestep_range: tuple[float, ...] = _timestep_range(
        (-1.0, 301.0), "the high-frequency difference is scaled by alpha_high_frequency at each skipped step"
    )
    alpha_low_frequency: float = setting(
        1.1, help="scale of the low-frequency branch difference per skipped step, inside its range"
    )
    alpha_high_frequency: float = setting(
        1.1, help="scale of the high-frequency branch difference per skipped step, inside its range"
    )
    is_guidance_distilled: bool | None = setting(
        None,
        help="true: never approximate the negative-prompt branch (attention reuse on both CFG branches); "
        "false: approximate it (needs a request with CFG); null: approximate it exactly when the request "
        "runs CFG",
    )

    def check_method(self) -> None:
        for name in (
            "spatial_attention_timestep_skip_range",
            "unconditional_batch_timestep_skip_range",
            "low_frequency_weight_update_timestep_range",
            "high_frequency_weight_update_timestep_range",
        ):
            _check_timestep_range(self.method, name, getattr(self, name))


#: Every method by name.
CACHE_METHODS: dict[str, type[CacheSettings]] = {
    cls.method: cls
    for cls in (
        NoCache,
        DBCacheSettings,
        TaylorSeerSettings,
        TeaCacheSettings,
        MagCacheSettings,
        ScmSettings,
        EasyCacheSettings,
        SeaCacheSettings,
        PabSettings,
        FasterCacheSettings,
    )
}
METHOD_NAMES = tuple(CACHE_METHODS)
#: `--cache` and `--cache-default`'s help, and the HTTP field's description.
CACHE_HELP = (
    "a cache accelerator and its settings, as JSON or 'method:key=value,...' (for example "
    "'dbcache:Fn_compute_blocks=1,residual_diff_threshold=0.12'); methods: " + ", ".join(METHOD_NAMES) + "; "
    "settings as cache-dit/SGLang/diffusers name them; unset: no cache"
)


def _check_mask(mask: tuple[int, ...] | str | None) -> None:
    if isinstance(mask, str) and mask not in SCHEDULE_NAMES:
        raise _fail(
            f"steps_computation_mask {mask!r} is neither a list of 1/0 nor a schedule: {', '.join(SCHEDULE_NAMES)}"
        )
    if isinstance(mask, tuple) and (not mask or any(v not in (0, 1) for v in mask)):
        raise _fail(f"steps_computation_mask must hold 1 (compute) and 0 (reuse) only, got {list(mask)}")


def _check_value(method: str, name: str, value: Any, hint: Any, rule: SettingRule) -> None:
    """Raise naming `method.name` unless `value` has the declared type (a union: any of its members) and
    is within `rule`'s bounds and choices."""
    where = f"{method}.{name}"
    if not _has_type(value, hint):
        raise _fail(f"{where} must be {_type_words(hint)}, got {value!r}")
    items = value if isinstance(value, tuple) else (value,)
    if isinstance(value, tuple) and len(value) > MAX_SETTING_ITEMS:
        raise _fail(f"{where} holds {len(value)} values; at most {MAX_SETTING_ITEMS}")
    for item in items:
        if isinstance(item, float) and not math.isfinite(item):
            raise _fail(f"{where} must be finite, got {item!r}")
        number = isinstance(item, (int, float)) and not isinstance(item, bool)
        if number and rule.min is not None and item < rule.min:
            raise _fail(f"{where} must be >= {rule.min:g}, got {item!r}")
        if number and rule.max is not None and item > rule.max:
            raise _fail(f"{where} must be <= {rule.max:g}, got {item!r}")
        if isinstance(item, str) and rule.choices is not None and item not in rule.choices:
            raise _fail(f"{where} must be one of {', '.join(rule.choices)}, got {item!r}")


def _has_type(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        (item,) = {arg for arg in typing.get_args(hint) if arg is not Ellipsis}
        return isinstance(value, tuple) and all(_has_type(v, item) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_words(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {_type_words(typing.get_args(hint)[0])}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, "null" if hint is type(None) else str(hint)
    )


# ------------------------------------------------------------------------------------------- parsing


def parse_cache(value: object) -> CacheSettings | None:
    """A request's `cache` as settings (None: unset). See the module docstring for the spellings."""
    if value is None or isinstance(value, CacheSettings):
        if value is not None:
            value.check()
        return value
    if isinstance(value, str):
        return _from_mapping(_text_mapping(value.strip()))
    if isinstance(value, Mapping):
        return _from_mapping(value)
    raise _fail(
        f'expected an object such as {{"method": "dbcache", ...}} or text, got {type(value).__name__}'
    )


def cache_from_flag(text: str, flag: str) -> CacheSettings | None:
    """`--cache` / `--cache-default`'s convert: the settings, or an InvalidRequestError naming the flag."""
    try:
        return parse_cache(text)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{flag}: {str(exc).removeprefix('cache: ')}", param="cache") from None


def _from_mapping(values: Mapping[str, Any]) -> CacheSettings:
    method = values.get("method")
    if not isinstance(method, str) or method not in CACHE_METHODS:
        given = "no method" if method is None else f"method {method!r}"
        raise _fail(f"{given}; set method to one of {', '.join(METHOD_NAMES)}")
    cls = CACHE_METHODS[method]
    names = cls.setting_names()
    unknown = [key for key in values if key != "method" and key not in names]
    if unknown:
        keys = ", ".join(names) if names else "none"
        raise _fail(f"{method} has no setting {', '.join(map(repr, unknown))}; its settings: {keys}")
    kwargs = {key: _tuples(value) for key, value in values.items() if key != "method"}
    settings = cls(**kwargs)
    settings.check()
    return settings


def _tuples(value: Any) -> Any:
    """Lists as tuples (settings are frozen and hashable)."""
    return tuple(value) if isinstance(value, list) else value


def _text_mapping(text: str) -> dict[str, Any]:
    """JSON text, or "method" / "method:key=value,key=value" with each value read as JSON where it parses
    (numbers, true/false, null), as a list where it holds ';' ("1;1;0"), else as text."""
    if text.startswith("{"):
        try:
            loaded = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            raise _fail(f"not valid JSON: {text!r}") from None
        if not isinstance(loaded, dict):
            raise _fail(f"expected a JSON object, got {text!r}")
        return loaded
    method, _, rest = text.partition(":")
    values: dict[str, Any] = {"method": method.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise _fail(f"{item!r} is not key=value (in {text!r})")
        values[key.strip()] = _text_value(key.strip(), raw.strip())
    return values


def _text_value(key: str, raw: str) -> Any:
    if ";" in raw:
        return [_scalar(part.strip()) for part in raw.split(";") if part.strip()]
    if key == "steps_computation_mask" and raw and set(raw) <= {"0", "1"}:
        return [int(c) for c in raw]
    return _scalar(raw)


def _scalar(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def cache_default_from_flag(text: str, flag: str) -> str | None:
    """`--cache-default`'s convert: the settings checked, kept as their JSON text (what /server_info and
    the engine process carry); "none" or empty text: no default."""
    settings = cache_from_flag(text, flag) if text.strip() else None
    return None if settings is None or isinstance(settings, NoCache) else json.dumps(settings.to_dict())
