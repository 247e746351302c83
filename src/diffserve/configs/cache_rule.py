"""`CacheRule`: which cache methods a family's DiT runs, and a request's `cache` settings resolved for it.

A method the DiT does not support is refused, naming the family and the method, never run as the exact
path behind the user's back. Settings that depend on the model are checked or filled here: DBCache's
first and last blocks must fit in the DiT's blocks; TeaCache's coefficients and MagCache's ratios default
to the family's recorded ones (reported with the response, so the user sees which ran). No torch here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from diffserve.configs.cache_settings import (
    CacheSettings,
    DBCacheSettings,
    MagCacheSettings,
    NoCache,
    TeaCacheSettings,
)
from diffserve.configs.quality import AUTO, EXACT, TierPreset, canonical_tier, describe_preset
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.configs.step_masks import named_schedule
from diffserve.errors import InvalidRequestError

#: The methods that reuse the residual of all blocks at once: every DiT with a step cache runs them.
WHOLE_SPAN_METHODS = frozenset({"teacache", "magcache", "taylorseer", "scm", "easycache", "seacache"})
#: The methods that also need the DiT's blocks run in ranges (`models/cache_methods/blocks.py`).
BLOCK_RANGE_METHODS = frozenset({"dbcache"})
#: The methods that reuse attention modules' outputs (`layers/attention_reuse.py`): a DiT runs them when
#: its attention modules are `ReusableAttention`s.
ATTENTION_METHODS = frozenset({"pab", "fastercache"})


@dataclass(frozen=True)
class CacheRule:
    """What the `cache` of a family's requests may be.

    `methods`: the methods its DiT runs (besides "none"); `num_blocks`: the DiT's blocks, in the order the
    cache methods count them (FLUX: the double-stream blocks, then the single-stream ones); `range_offset`:
    its leading blocks that DBCache's Fn and Bn do not count and that always run (Z-Image's noise refiner,
    as cache-dit counts its main layers only);
    `teacache_coefficients` / `mag_ratios`: the family's defaults for those settings (None: it has none);
    `separate_cfg`: DBCache's `enable_separate_cfg` default, cache-dit's for the model (true where diffusers'
    pipeline runs the CFG branch as a forward of its own: Qwen-Image, Wan, HunyuanVideo 1.5);
    `separate_cfg_supported`: whether the pipeline can give the CFG branch a cache state of its own.
    """

    family: str
    methods: frozenset[str] = frozenset()
    num_blocks: int = 0
    range_offset: int = 0
    teacache_coefficients: tuple[float, ...] | None = None
    mag_ratios: tuple[float, ...] | None = None
    separate_cfg: bool = False
    separate_cfg_supported: bool = True

    def resolve(self, settings: CacheSettings | None) -> CacheSettings | None:
        """`settings` ready to run on this model (defaults filled), or a 400 naming `cache`."""
        if settings is None or isinstance(settings, NoCache):
            return settings
        settings.check()
        if settings.method not in self.methods:
            has = ", ".join(sorted(self.methods)) if self.methods else "none yet"
            raise InvalidRequestError(
                f"cache method {settings.method!r} is not supported by {self.family}'s DiT yet (its cache "
                f"methods: {has}); pass another method, or omit cache",
                param="cache",
            )
        if isinstance(settings, DBCacheSettings):
            used = settings.Fn_compute_blocks + settings.Bn_compute_blocks
            counted = self.num_blocks - self.range_offset
            if used > counted:
                raise InvalidRequestError(
                    f"cache: dbcache's Fn_compute_blocks ({settings.Fn_compute_blocks}) + Bn_compute_blocks "
                    f"({settings.Bn_compute_blocks}) exceed {self.family}'s {counted} DiT blocks",
                    param="cache",
                )
            if settings.enable_separate_cfg is None:
                separate = self.separate_cfg and self.separate_cfg_supported
                settings = dataclasses.replace(settings, enable_separate_cfg=separate)
            elif settings.enable_separate_cfg and not self.separate_cfg_supported:
                raise InvalidRequestError(
                    f"cache: dbcache's enable_separate_cfg is not supported by {self.family} (its guidance "
                    "branches share one cache state); pass false or omit it",
                    param="cache",
                )
        if isinstance(settings, TeaCacheSettings) and settings.coefficients is None:
            settings = dataclasses.replace(settings, coefficients=self.teacache_coefficients)
        if isinstance(settings, MagCacheSettings) and settings.mag_ratios is None:
            if self.mag_ratios is None and not settings.magcache_calibrate:
                raise InvalidRequestError(
                    f"cache: magcache needs mag_ratios for {self.family} (it records none): measure them "
                    'once with {"method": "magcache", "magcache_calibrate": true} (the response reports '
                    "them), then pass them as mag_ratios",
                    param="cache",
                )
            settings = dataclasses.replace(settings, mag_ratios=self.mag_ratios)
        return settings

    def resolve_preset(self, tier: str, preset: TierPreset) -> TierPreset:
        """A quality tier's `preset` ready to run on this model (as `resolve` does for a request's `cache`),
        or a ValueError naming the tier: a preset this DiT cannot run is refused at startup, never served
        as the exact path. The original step cache (`StepCachePolicy`) runs on every DiT with a step cache
        (one that runs the whole-span methods)."""
        if isinstance(preset, StepCachePolicy):
            if not self.methods & WHOLE_SPAN_METHODS:
                raise ValueError(f"quality {tier!r}: {self.family}'s DiT has no step cache")
            return preset
        if preset.method not in self.methods:
            has = ", ".join(sorted(self.methods)) or "none"
            raise ValueError(
                f"quality {tier!r} runs {describe_preset(preset)}, which {self.family}'s DiT does not run "
                f"(its cache methods: {has}); rerun `diffserve calibrate-cache` for this model"
            )
        try:
            resolved = self.resolve(preset)
        except InvalidRequestError as exc:
            raise ValueError(f"quality {tier!r} runs {describe_preset(preset)}: {exc}") from None
        assert resolved is not None and not isinstance(resolved, NoCache), "a preset reuses work"
        return resolved


def choose_cache(
    requested: CacheSettings | None,
    requested_quality: str | None,
    tier: str,
    rule: CacheRule,
    default: CacheSettings | None,
) -> tuple[CacheSettings | None, str]:
    """(the cache a request runs, resolved for its model; the quality tier it runs at).

    A request's own `cache` wins over the engine's `--cache-default` (`NoCache`: the exact path); with an
    approximate `quality` asked for by name it is a 400 (both pick how to skip work), while a `quality` left
    unset or `auto` then means the exact tier. The default applies to requests that set neither cache nor an
    approximate tier. `tier`: the request's resolved quality tier.
    """
    asked_tier = requested_quality is not None and canonical_tier(requested_quality) != AUTO
    if requested is not None:
        if asked_tier and tier != EXACT:
            raise InvalidRequestError(
                f"pass either cache or quality={requested_quality!r}: both choose how the DiT reuses work "
                "between steps (quality 'high' or unset goes with any cache)",
                param="cache",
            )
        return rule.resolve(requested), EXACT
    if tier == EXACT and default is not None and not asked_tier:
        return rule.resolve(default), EXACT
    return None, tier


def named_schedule_error(settings: object, num_steps: int) -> str | None:
    """Why the named steps computation schedule (`steps_computation_mask`) of a cache method's settings or
    a tier's preset has no form for `num_steps` denoising steps; None where it has one, or where the
    settings name no schedule (a mask given as a list, or none). The request checks word the refusal."""
    mask = getattr(settings, "steps_computation_mask", None)
    if not isinstance(mask, str):
        return None
    try:
        named_schedule(mask, num_steps)
    except ValueError as exc:
        return str(exc)
    return None


def check_cache_steps(settings: CacheSettings | None, num_steps: int) -> None:
    """A 400 naming `cache` when its named steps computation schedule has no form for the `num_steps`
    denoising steps the request runs (cache-dit's schedules need 4, 6 or at least 8)."""
    error = named_schedule_error(settings, num_steps)
    if error is not None:
        raise InvalidRequestError(f"cache: {error} (or pass cache 'none' for the exact path)", param="cache")


def check_tier_steps(tier: str, preset: TierPreset, num_steps: int) -> None:
    """A 400 naming `quality` when the tier's preset names a steps computation schedule that has no form
    for the request's `num_steps` denoising steps (cache-dit's schedules need 4, 6 or at least 8): the
    tier cannot keep its promise there, and running it exact instead would be a silent change."""
    error = named_schedule_error(preset, num_steps)
    if error is not None:
        raise InvalidRequestError(
            f"quality {tier!r} runs {describe_preset(preset)} on this model: {error}; ask for quality 'high' "
            "or another step count",
            param="quality",
        )
