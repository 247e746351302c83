"""diffserve's step cache ("stepcache"), the quality tiers' original method and still one of the presets a
tier may resolve to (`configs/quality.py`), per request: TeaCache-like reuse of all blocks' residual
while the accumulated relative L1 change of the first block's timestep-modulated input, since the last
computed step, stays below the policy's threshold (`StepCachePolicy`).

The first `full_first_steps` and last `full_last_steps` steps always compute, and a step computes after
`max_reuse_in_a_row` reused ones, so the error cannot grow unchecked.
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.models.cache_methods.base import CachedResidual, Plan, relative_l1
from diffserve.models.cache_methods.residual_state import CachedResidualState


class StepCacheState(CachedResidualState):
    """One approximate-tier request's cache: what it last saw and what it can reuse, plus its counts."""

    method = StepCachePolicy.method
    probe = "signal"

    def __init__(self, policy: StepCachePolicy, num_blocks: int = 0) -> None:
        super().__init__(num_blocks, CachedResidual())
        self.policy = policy
        self.accumulated_change = 0.0
        self.last_signal: torch.Tensor | None = None
        self.reused_in_a_row = 0

    @property
    def residual(self) -> torch.Tensor | None:
        """The cached residual of the image tokens (None before a computed step)."""
        return None if self.cached.residual is None else self.cached.residual.image

    def relative_change(self, signal: torch.Tensor) -> torch.Tensor | None:
        """Mean |signal - last| / mean |last| as a 0-d tensor (no host sync), None on the first step."""
        return relative_l1(signal, self.last_signal)

    def plan(self, step: int, num_steps: int) -> Plan:
        return Plan.MEASURE  # `decide` forces the full steps itself, after accumulating the change

    def measure(self, probe: torch.Tensor) -> torch.Tensor | None:
        return self.relative_change(probe)

    def decide(self, change: float | None, step: int, num_steps: int) -> bool:
        """True to reuse the residual this step. Updates the accumulated change either way."""
        policy = self.policy
        if change is not None:
            self.accumulated_change += change
        forced_full = (
            not self.cached.present
            or change is None
            or step < policy.full_first_steps
            or step >= num_steps - policy.full_last_steps
            or self.reused_in_a_row >= policy.max_reuse_in_a_row
        )
        return not forced_full and self.accumulated_change < policy.threshold

    def keep_probe(self, probe: torch.Tensor, reused: bool) -> None:
        self.last_signal = probe.detach().clone()

    def record(self, reused: bool) -> None:
        super().record(reused)
        if reused:
            self.reused_in_a_row += 1
        else:
            self.reused_in_a_row = 0
            self.accumulated_change = 0.0

    def settings_report(self) -> dict[str, Any]:
        return {"method": self.method, **self.policy.to_dict()}  # as the other methods' settings read
