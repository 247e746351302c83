"""`CachedResidualState`: the part every `CachedResidual`-backed method shares (all but SeaCache, which keeps
its own list of computed residuals), and `AccumulatedChange`, the running sum that TeaCache and EasyCache
reuse below a threshold.

Each of DBCache, TaylorSeer, TeaCache, MagCache, SCM, EasyCache and the step cache stores the residual of a
step that ran the span and adds it back (or its TaylorSeer extrapolation) on a reused one; they differ only
in when they reuse (`plan`, `decide`). Keeping the residual handling here gives them one definition of it.
"""

from __future__ import annotations

from diffserve.models.cache_methods.base import CachedResidual, RequestCache
from diffserve.models.cache_methods.blocks import Streams


class CachedResidualState(RequestCache):
    """A `RequestCache` whose residual is a `CachedResidual` (`self.cached`): storing a computed step's
    residual and handing it back on a reused step are the same for every such method."""

    def __init__(self, num_blocks: int, cached: CachedResidual) -> None:
        super().__init__(num_blocks)
        self.cached = cached

    @property
    def has_residual(self) -> bool:
        return self.cached.present

    def reused_residual(self, step: int) -> Streams:
        return self.cached.at(step)

    def store(self, residual: Streams, step: int) -> None:
        self.cached.store(residual, step)


class AccumulatedChange:
    """The changes measured since the last computed step, added up: a step reuses while the sum stays below
    the method's threshold, and a step that computes (or cannot compare) starts the sum again."""

    def __init__(self) -> None:
        self.total = 0.0

    def reset(self) -> None:
        self.total = 0.0

    def reuses(self, change: float | None, threshold: float) -> bool:
        """Add `change` (None: not comparable, compute) and say whether the sum is still below `threshold`;
        the sum restarts at 0 when it is not."""
        if change is None:
            self.total = 0.0
            return False
        self.total += change
        if self.total < threshold:
            return True
        self.total = 0.0
        return False
