"""TaylorSeer alone (arXiv 2503.06923), per request, scheduled as diffusers' `TaylorSeerCacheConfig`:
every block runs during the first `disable_cache_before_step` steps, then every `cache_interval`-th step
(and from `disable_cache_after_step` on); the steps in between add the blocks' residual extrapolated by a
Taylor series of `taylorseer_order` through the computed steps. diffusers extrapolates each attention
output; here it is the residual of all blocks, so a reused step runs no block at all.
"""

from __future__ import annotations

from typing import Any

from diffserve.configs.cache_settings import TaylorSeerSettings
from diffserve.models.cache_methods.base import CachedResidual, Plan
from diffserve.models.cache_methods.residual_state import CachedResidualState


class TaylorSeerState(CachedResidualState):
    method = "taylorseer"

    def __init__(self, settings: TaylorSeerSettings, num_blocks: int) -> None:
        super().__init__(num_blocks, CachedResidual(settings.taylorseer_order))
        self.settings = settings

    @property
    def kept_states(self) -> int:
        return 1 + self.settings.taylorseer_order  # the residual and its Taylor factors

    def plan(self, step: int, num_steps: int) -> Plan:
        s = self.settings
        warmup = step < s.disable_cache_before_step
        interval = (step - s.disable_cache_before_step - 1) % s.cache_interval == 0
        cooldown = s.disable_cache_after_step is not None and step >= s.disable_cache_after_step
        if warmup or interval or cooldown or not self.cached.present:
            return Plan.COMPUTE
        return Plan.REUSE

    def settings_report(self) -> dict[str, Any]:
        return self.settings.to_dict()
