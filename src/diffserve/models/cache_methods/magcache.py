"""MagCache (arXiv 2506.09045), per request: the magnitude of the blocks' residual changes between
consecutive steps by a ratio that is nearly the same for every prompt of a model, so the error of reusing
it can be predicted without looking at the step's input.

After the first `retention_ratio` of the steps, each step multiplies an accumulated ratio by the model's
ratio for that step and adds |1 - accumulated ratio| to an accumulated error; while that error stays
within `magcache_thresh` and at most `magcache_K` steps were reused since the last computed one, the
cached residual is reused, else the step computes and the accumulators restart (diffusers' `MagCacheConfig`
semantics). `mag_ratios` are resampled (nearest) to the request's step count. With `magcache_calibrate`
nothing is reused: each step's measured ratio, mean over tokens of |r_t| / |r_{t-1}|, is reported instead.
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.configs.cache_settings import MagCacheSettings
from diffserve.models.cache_methods.base import CachedResidual, Plan
from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.cache_methods.residual_state import CachedResidualState


def resampled(ratios: tuple[float, ...], num_steps: int) -> list[float]:
    """`ratios` stretched or shrunk to `num_steps` entries by nearest neighbour (diffusers' `nearest_interp`)."""
    if len(ratios) == num_steps:
        return list(ratios)
    if num_steps == 1:
        return [ratios[-1]]
    scale = (len(ratios) - 1) / (num_steps - 1)
    return [ratios[round(i * scale)] for i in range(num_steps)]


class MagCacheState(CachedResidualState):
    method = "magcache"

    def __init__(self, settings: MagCacheSettings, num_blocks: int) -> None:
        super().__init__(num_blocks, CachedResidual())
        self.settings = settings
        self.ratios: list[float] | None = None
        self.accumulated_ratio = 1.0
        self.accumulated_error = 0.0
        self.accumulated_steps = 0
        self.measured_ratios: list[float] = []

    @property
    def kept_states(self) -> int:
        return 1  # the residual

    def plan(self, step: int, num_steps: int) -> Plan:
        s = self.settings
        if s.magcache_calibrate:
            return Plan.COMPUTE
        if self.ratios is None:
            assert s.mag_ratios is not None, "CacheRule.resolve fills mag_ratios"
            self.ratios = resampled(s.mag_ratios, num_steps)
        if step < int(s.retention_ratio * num_steps + 0.5):
            return Plan.COMPUTE
        self.accumulated_ratio *= self.ratios[step] if step < len(self.ratios) else 1.0
        self.accumulated_steps += 1
        self.accumulated_error += abs(1.0 - self.accumulated_ratio)
        if (
            self.cached.present
            and self.accumulated_error <= s.magcache_thresh
            and self.accumulated_steps <= s.magcache_K
        ):
            return Plan.REUSE
        self.accumulated_ratio, self.accumulated_error, self.accumulated_steps = 1.0, 0.0, 0
        return Plan.COMPUTE

    def store(self, residual: Streams, step: int) -> None:
        if self.settings.magcache_calibrate:
            self.measured_ratios.append(self._ratio(residual.image))
        super().store(residual, step)

    def _ratio(self, current: torch.Tensor) -> float:
        if self.cached.residual is None:
            return 1.0
        previous = self.cached.residual.image
        now, before = current.float().norm(dim=-1), previous.float().norm(dim=-1)
        return float((now / (before + 1e-8)).mean())

    def settings_report(self) -> dict[str, Any]:
        return self.settings.to_dict()

    def extra_report(self) -> dict[str, Any]:
        return {"measured_mag_ratios": self.measured_ratios} if self.settings.magcache_calibrate else {}
