"""A fixed steps computation mask (cache-dit's SCM, static policy), per request: steps whose mask entry is
1 run every block, those with 0 add the blocks' cached residual (extrapolated by TaylorSeer when enabled).
A named schedule is resolved for the request's step count (`configs/step_masks.py`); steps past an
explicit mask's end compute.
"""

from __future__ import annotations

from typing import Any

from diffserve.configs.cache_settings import ScmSettings
from diffserve.models.cache_methods.base import CachedResidual, Plan
from diffserve.models.cache_methods.dbcache import steps_mask
from diffserve.models.cache_methods.residual_state import CachedResidualState


class ScmState(CachedResidualState):
    method = "scm"

    def __init__(self, settings: ScmSettings, num_blocks: int) -> None:
        order = settings.taylorseer_order if settings.enable_taylorseer else None
        super().__init__(num_blocks, CachedResidual(order, None, 2))
        self.settings = settings
        self.mask: tuple[int, ...] | None = None

    @property
    def kept_states(self) -> int:
        return 1 + (self.settings.taylorseer_order if self.settings.enable_taylorseer else 0)

    def plan(self, step: int, num_steps: int) -> Plan:
        if self.mask is None:
            self.mask = steps_mask(self.settings.steps_computation_mask, num_steps)
        assert self.mask is not None
        if step >= len(self.mask) or self.mask[step] == 1 or not self.cached.present:
            return Plan.COMPUTE
        return Plan.REUSE

    def settings_report(self) -> dict[str, Any]:
        return {**self.settings.to_dict(), "resolved_mask": list(self.mask or ())}
