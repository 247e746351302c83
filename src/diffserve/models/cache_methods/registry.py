"""The cache methods by name: a request's resolved settings -> its `RequestCache`."""

from __future__ import annotations

from collections.abc import Callable

from diffserve.configs.cache_settings import (
    CacheSettings,
    DBCacheSettings,
    MagCacheSettings,
    NoCache,
    ScmSettings,
    TaylorSeerSettings,
    TeaCacheSettings,
)
from diffserve.models.cache_methods.base import RequestCache
from diffserve.models.cache_methods.dbcache import DBCacheState
from diffserve.models.cache_methods.magcache import MagCacheState
from diffserve.models.cache_methods.scm import ScmState
from diffserve.models.cache_methods.taylorseer import TaylorSeerState
from diffserve.models.cache_methods.teacache import TeaCacheState

#: Settings class -> the state that runs it (`NoCache` has none: the exact path).
STATES: dict[type[CacheSettings], Callable[..., RequestCache]] = {
    DBCacheSettings: DBCacheState,
    TaylorSeerSettings: TaylorSeerState,
    TeaCacheSettings: TeaCacheState,
    MagCacheSettings: MagCacheState,
    ScmSettings: ScmState,
}


def new_request_cache(settings: CacheSettings | None, num_blocks: int) -> RequestCache | None:
    """A request's cache state for its resolved `settings` (None or `NoCache`: none, the exact path)."""
    if settings is None or isinstance(settings, NoCache):
        return None
    return STATES[type(settings)](settings, num_blocks)
