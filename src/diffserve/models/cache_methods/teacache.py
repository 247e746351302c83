"""TeaCache (arXiv 2411.19108), per request: reuse the blocks' residual while the change of the first
block's timestep-modulated input, rescaled by a polynomial fitted per model and accumulated since the
last computed step, stays below `rel_l1_thresh`.

Each step measures mean |m_t - m_{t-1}| / mean |m_{t-1}| of the modulated input m (the DiT's step-cache
signal), against the previous step's whether it computed or not. The first and last steps always compute.
`coefficients` (highest power first) rescale that change; without them the change is used as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.configs.cache_settings import TeaCacheSettings
from diffserve.models.cache_methods.base import CachedResidual, Plan, relative_l1
from diffserve.models.cache_methods.residual_state import AccumulatedChange, CachedResidualState


def polynomial(coefficients: tuple[float, ...] | None, x: float) -> float:
    """sum c_i x^(n-i) (Horner), highest power first; `x` itself without coefficients."""
    if coefficients is None:
        return x
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value


class TeaCacheState(CachedResidualState):
    method = "teacache"
    probe = "signal"

    def __init__(self, settings: TeaCacheSettings, num_blocks: int) -> None:
        super().__init__(num_blocks, CachedResidual())
        self.settings = settings
        self.previous_signal: torch.Tensor | None = None
        self.accumulated = AccumulatedChange()

    def plan(self, step: int, num_steps: int) -> Plan:
        if step == 0 or step == num_steps - 1 or not self.cached.present:
            self.accumulated.reset()
            return Plan.COMPUTE
        return Plan.MEASURE

    def measure(self, probe: torch.Tensor) -> torch.Tensor | None:
        return relative_l1(probe, self.previous_signal)

    def decide(self, change: float | None, step: int, num_steps: int) -> bool:
        rescaled = None if change is None else polynomial(self.settings.coefficients, change)
        return self.accumulated.reuses(rescaled, self.settings.rel_l1_thresh)

    def keep_probe(self, probe: torch.Tensor, reused: bool) -> None:
        self.previous_signal = probe.detach()

    def settings_report(self) -> dict[str, Any]:
        return self.settings.to_dict()
