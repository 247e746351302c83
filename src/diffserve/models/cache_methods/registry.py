"""The cache methods by name: a request's resolved settings (or its quality tier's preset) -> its
`RequestCache`."""

from __future__ import annotations

from collections.abc import Callable

from diffserve.configs.cache_settings import (
    CacheSettings,
    DBCacheSettings,
    EasyCacheSettings,
    FasterCacheSettings,
    MagCacheSettings,
    NoCache,
    PabSettings,
    ScmSettings,
    SeaCacheSettings,
    TaylorSeerSettings,
    TeaCacheSettings,
)
from diffserve.configs.quality import TierPreset
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.models.cache_methods.attention_level import FasterCacheState, PabState
from diffserve.models.cache_methods.base import RequestCache
from diffserve.models.cache_methods.dbcache import DBCacheState
from diffserve.models.cache_methods.easycache import EasyCacheState
from diffserve.models.cache_methods.magcache import MagCacheState
from diffserve.models.cache_methods.scm import ScmState
from diffserve.models.cache_methods.seacache import SeaCacheState
from diffserve.models.cache_methods.taylorseer import TaylorSeerState
from diffserve.models.cache_methods.teacache import TeaCacheState
from diffserve.models.cache_methods.tier import StepCacheState

#: Settings class -> the state that runs it (`NoCache` has none: the exact path).
STATES: dict[type[CacheSettings], Callable[..., RequestCache]] = {
    DBCacheSettings: DBCacheState,
    TaylorSeerSettings: TaylorSeerState,
    TeaCacheSettings: TeaCacheState,
    MagCacheSettings: MagCacheState,
    ScmSettings: ScmState,
    EasyCacheSettings: EasyCacheState,
    SeaCacheSettings: SeaCacheState,
    PabSettings: PabState,
    FasterCacheSettings: FasterCacheState,
}


def new_request_cache(
    settings: CacheSettings | None, num_blocks: int, range_offset: int = 0
) -> RequestCache | None:
    """A request's cache state for its resolved `settings` (None or `NoCache`: none, the exact path).
    `range_offset`: the DiT's leading blocks DBCache does not count (`CacheRule.range_offset`)."""
    if settings is None or isinstance(settings, NoCache):
        return None
    if isinstance(settings, DBCacheSettings):
        return DBCacheState(settings, num_blocks, range_offset)
    return STATES[type(settings)](settings, num_blocks)


def add_cfg_branch(state: RequestCache, settings: object, num_blocks: int, range_offset: int = 0) -> None:
    """Give a CFG request's cache what its settings do with the CFG branch: a state of its own when they
    keep that branch apart (DBCache's `enable_separate_cfg`, resolved by the family's `CacheRule`);
    FasterCache's approximation of it unless they say `is_guidance_distilled`; else nothing."""
    if isinstance(settings, DBCacheSettings) and settings.enable_separate_cfg:
        state.cfg_branch = DBCacheState(settings, num_blocks, range_offset)
    elif (
        isinstance(state, FasterCacheState)
        and isinstance(settings, FasterCacheSettings)
        and settings.is_guidance_distilled is not True
    ):
        state.approximate_unconditional()


def new_tier_cache(tier: str, preset: TierPreset, num_blocks: int, range_offset: int = 0) -> RequestCache:
    """The cache of a request at quality `tier`, which runs the tier's resolved `preset`; its report names
    the tier next to the method and settings."""
    state = StepCacheState(preset, num_blocks) if isinstance(preset, StepCachePolicy) else None
    if state is None:
        state = new_request_cache(preset, num_blocks, range_offset)
    if state is None:
        raise ValueError(f"quality {tier!r} has no preset that reuses work: {preset!r}")
    state.tier = tier
    return state
