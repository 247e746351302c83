"""DBCache (cache-dit's Dual Block Cache), per request.

Every step runs the first `Fn_compute_blocks` blocks. Their output residual (output minus their input,
image tokens) is compared with the one of the last step that ran the middle blocks: while the
relative L1 change stays below `residual_diff_threshold`, the middle blocks are skipped and their cached
residual (image and text streams) is added instead, optionally extrapolated by TaylorSeer. The last
`Bn_compute_blocks` blocks always run. The checks before the threshold, in cache-dit's order: warm-up
steps, the steps computation mask, `max_cached_steps`, `max_continuous_cached_steps`,
`max_accumulated_residual_diff_threshold`; a threshold of 0 never reuses, 1 or more always does.
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.configs.cache_settings import DBCacheSettings
from diffserve.configs.step_masks import named_schedule
from diffserve.models.cache_methods.base import CachedResidual, Plan, relative_l1
from diffserve.models.cache_methods.residual_state import CachedResidualState


def steps_mask(mask: tuple[int, ...] | str | None, num_steps: int) -> tuple[int, ...] | None:
    """A settings' mask for a request of `num_steps` steps: a named schedule resolved (cache-dit's)."""
    if isinstance(mask, str):
        return tuple(named_schedule(mask, num_steps))
    return mask


class DBCacheState(CachedResidualState):
    method = "dbcache"
    probe = "residual"

    def __init__(self, settings: DBCacheSettings, num_blocks: int, range_offset: int = 0) -> None:
        """`range_offset`: the DiT's leading blocks that Fn and Bn do not count and that always run
        (Z-Image's noise refiner: cache-dit's DBCache counts its main layers only)."""
        order = settings.taylorseer_order
        cached = CachedResidual(
            order if settings.enable_taylorseer else None,
            order if settings.enable_encoder_taylorseer else None,
            first_difference_step=2,  # cache-dit's calibrator takes no difference before step 2
        )
        super().__init__(num_blocks, cached)
        self.settings = settings
        self.range_offset = range_offset
        self.mask: tuple[int, ...] | None = None
        self.mask_resolved = False
        self.probe_reference: torch.Tensor | None = None  # the Fn residual of the last computed step
        self.cached_steps = 0
        self.cached_in_a_row = 0
        self.accumulated_diff = 0.0
        self.diffs: list[float] = []

    @property
    def kept_states(self) -> int:
        """The middle blocks' residual and the first blocks' reference, plus TaylorSeer's factors."""
        return 2 + (self.settings.taylorseer_order if self.settings.enable_taylorseer else 0)

    def span(self) -> tuple[int, int]:
        s = self.settings
        return self.range_offset + s.Fn_compute_blocks, self.num_blocks - s.Bn_compute_blocks

    @property
    def probe_base(self) -> int:
        """The first counted block: the probe is the residual of the first `Fn_compute_blocks` of them."""
        return self.range_offset

    def _in_warmup(self, step: int) -> bool:
        s, warmup = self.settings, self.settings.max_warmup_steps
        if self.mask is not None:  # a mask's leading computed steps bound the warm-up (cache-dit)
            leading = next((i for i, m in enumerate(self.mask) if m != 1), len(self.mask))
            warmup = min(warmup, leading)
        return step < warmup and step % s.warmup_interval == 0

    def plan(self, step: int, num_steps: int) -> Plan:
        s = self.settings
        if not self.mask_resolved:
            self.mask, self.mask_resolved = steps_mask(s.steps_computation_mask, num_steps), True
        if self._in_warmup(step):
            return Plan.COMPUTE
        if self.mask is not None and step < len(self.mask):
            if self.mask[step] == 1:
                return Plan.COMPUTE
            if s.steps_computation_policy == "static":
                return Plan.REUSE if self.has_residual else Plan.COMPUTE
        if 0 <= s.max_cached_steps <= self.cached_steps:
            return Plan.COMPUTE
        if 0 <= s.max_continuous_cached_steps <= self.cached_in_a_row:
            return Plan.COMPUTE
        limit = s.max_accumulated_residual_diff_threshold
        if limit is not None and limit > 0 and self.accumulated_diff >= limit:
            return Plan.COMPUTE
        if s.residual_diff_threshold <= 0 or self.probe_reference is None or not self.has_residual:
            return Plan.COMPUTE
        if s.residual_diff_threshold >= 1:
            return Plan.REUSE
        return Plan.MEASURE

    def measure(self, probe: torch.Tensor) -> torch.Tensor | None:
        return relative_l1(probe, self.probe_reference)

    def decide(self, change: float | None, step: int, num_steps: int) -> bool:
        if change is None:  # another shape than the reference's
            return False
        self.diffs.append(change)
        if change > 0:
            self.accumulated_diff += change
        return change < self.settings.residual_diff_threshold

    def keep_probe(self, probe: torch.Tensor, reused: bool) -> None:
        if not reused:  # cache-dit keeps the Fn residual of computed steps only
            self.probe_reference = probe.detach()

    def record(self, reused: bool) -> None:
        super().record(reused)
        if reused:
            self.cached_steps += 1
            self.cached_in_a_row += 1
        else:
            self.cached_in_a_row = 0

    def settings_report(self) -> dict[str, Any]:
        return self.settings.to_dict()
