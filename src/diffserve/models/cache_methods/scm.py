"""A fixed steps computation mask (cache-dit's SCM, static policy), per request: steps whose mask entry is
1 run every block, those with 0 add the blocks' cached residual (extrapolated by TaylorSeer when enabled).
A named schedule is resolved for the request's step count (`configs/step_masks.py`); steps past an
explicit mask's end compute.
"""

from __future__ import annotations

from typing import Any

from diffserve.configs.cache_settings import ScmSettings
from diffserve.models.cache_methods.base import CachedResidual, Plan, RequestCache
from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.cache_methods.dbcache import steps_mask


class ScmState(RequestCache):
    method = "scm"

    def __init__(self, settings: ScmSettings, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.settings = settings
        self.mask: tuple[int, ...] | None = None
        self.cached = CachedResidual(
            settings.taylorseer_order if settings.enable_taylorseer else None, None, 2
        )

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

    @property
    def has_residual(self) -> bool:
        return self.cached.present

    def reused_residual(self, step: int) -> Streams:
        return self.cached.at(step)

    def store(self, residual: Streams, step: int) -> None:
        self.cached.store(residual, step)

    def settings_report(self) -> dict[str, Any]:
        return {**self.settings.to_dict(), "resolved_mask": list(self.mask or ())}
