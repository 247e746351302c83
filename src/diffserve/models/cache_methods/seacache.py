"""SeaCache (arXiv 2602.18993), per request, decided as diffusers' `SeaCacheConfig` decides.

Its probe is the step's input latents on their grid, (outputs, channels, frames, height, width), and the
step's noise level sigma (the probe "latent": the pipeline gives both, `batch.CacheRows.latent`). The
latents are filtered in the frequency domain over (frames, height, width) by a Wiener-like gain per axis,
(1 - sigma) P / ((1 - sigma)^2 P + sigma^2) with a clean-signal power prior P = 1 / |f|^power_exp, the
axes' gains multiplied and normalized to unit mean: the "spectral-evolution-aware" indicator, which keeps
what the noise level leaves of the image's structure. Each step compares its indicator with the previous
step's (computed or reused): mean |a - b| / mean |b| per output, averaged over the outputs. These changes
add up; a step reuses while the sum stays below `threshold`, else it computes and the sum restarts.

The first `retention_steps` and last `cache_end_steps` steps compute, as does the first observation and a
step after `max_consecutive_cached` reused ones in a row (0: no limit). A reused step adds the residual of
the last computed step (`residual_order` 0), or (order 1) its linear extrapolation through the last two
computed steps: r_b + (r_b - r_a) (t - b) / (b - a).
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.configs.cache_settings import SeaCacheSettings
from diffserve.models.cache_methods.base import Plan, RequestCache
from diffserve.models.cache_methods.blocks import Streams


def spectral_gain(
    shape: tuple[int, int, int], sigma: float, power_exp: float, device: torch.device
) -> torch.Tensor:
    """The (frames, height, width) gain at noise level `sigma`, float32, normalized to unit mean."""
    sigma = min(max(sigma, 1e-6), 1.0 - 1e-6)
    signal, noise = 1.0 - sigma, sigma
    gain = None
    for axis, n in enumerate(shape):
        f = torch.fft.fftfreq(n, device=device, dtype=torch.float32)
        prior = 1.0 / (f.abs().pow(power_exp) + 1e-16)
        g = signal * prior / (signal**2 * prior + noise**2 + 1e-16)
        view = [1, 1, 1]
        view[axis] = n
        gain = g.reshape(view) if gain is None else gain * g.reshape(view)
    assert gain is not None
    mean = gain.mean()
    if torch.isfinite(mean) and mean > 0:
        gain = gain / mean
    return gain


def sea_indicator(grid: torch.Tensor, sigma: float, power_exp: float) -> torch.Tensor:
    """The filtered latents of `grid` (outputs, channels, frames, height, width), as (outputs, frames,
    height, width, channels) in the latents' dtype."""
    x = grid.movedim(1, -1).contiguous().float()
    spectrum = torch.fft.fftn(x, dim=(1, 2, 3))
    gain = spectral_gain(tuple(x.shape[1:4]), sigma, power_exp, x.device).unsqueeze(-1)
    return torch.fft.ifftn(spectrum * gain, dim=(1, 2, 3)).real.to(grid.dtype)


class SeaCacheState(RequestCache):
    method = "seacache"
    probe = "latent"

    def __init__(self, settings: SeaCacheSettings, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.settings = settings
        self.previous: torch.Tensor | None = None  # the last step's indicator
        self.accumulated = 0.0
        self.in_a_row = 0
        #: (step, residual) of the last computed steps, oldest first (at most residual_order + 1).
        self.computed: list[tuple[int, Streams]] = []
        self.distances: list[float] = []

    @property
    def kept_states(self) -> int:
        """The last computed residuals (two for order 1) and the indicator (latent-sized: counted as one)."""
        return self.settings.residual_order + 2

    def indicator(self, grid: torch.Tensor, sigma: float) -> torch.Tensor:
        """This step's probe from the pipeline's latent grid and sigma (`sea_indicator`)."""
        return sea_indicator(grid, sigma, self.settings.power_exp)

    def plan(self, step: int, num_steps: int) -> Plan:
        s = self.settings
        forced = (
            step < s.retention_steps
            or step >= num_steps - s.cache_end_steps
            or self.previous is None
            or (s.max_consecutive_cached > 0 and self.in_a_row >= s.max_consecutive_cached)
            or not self.has_residual
        )
        if forced:
            self.accumulated = 0.0
            return Plan.COMPUTE
        return Plan.MEASURE

    def measure(self, probe: torch.Tensor) -> torch.Tensor | None:
        previous = self.previous
        if previous is None or previous.shape != probe.shape or previous.dtype != probe.dtype:
            return None
        current, before = probe.float().flatten(1), previous.float().flatten(1)
        per_output = (current - before).abs().mean(dim=1) / (before.abs().mean(dim=1) + 1e-16)
        return per_output.mean()

    def decide(self, change: float | None, step: int, num_steps: int) -> bool:
        if change is None or change != change or change == float("inf"):
            self.accumulated = 0.0
            return False
        self.distances.append(change)
        candidate = self.accumulated + change
        if candidate >= self.settings.threshold or not self.has_residual:
            self.accumulated = 0.0
            return False
        self.accumulated = candidate
        return True

    def keep_probe(self, probe: torch.Tensor, reused: bool) -> None:
        self.previous = probe.detach()

    @property
    def has_residual(self) -> bool:
        return bool(self.computed)

    def reused_residual(self, step: int) -> Streams:
        if not self.computed:
            raise RuntimeError("no residual is cached yet: a step must compute the blocks first")
        latest_step, latest = self.computed[-1]
        if self.settings.residual_order == 1 and len(self.computed) >= 2:
            previous_step, previous = self.computed[-2]
            if latest_step != previous_step:
                scale = (step - latest_step) / (latest_step - previous_step)
                return Streams(latest.image + (latest.image - previous.image) * scale, latest.text)
        return latest

    def store(self, residual: Streams, step: int) -> None:
        text = None if residual.text is None else residual.text.detach()
        self.computed.append((step, Streams(residual.image.detach(), text)))
        del self.computed[: -(self.settings.residual_order + 1)]

    def record(self, reused: bool) -> None:
        super().record(reused)
        self.in_a_row = self.in_a_row + 1 if reused else 0

    def settings_report(self) -> dict[str, Any]:
        return self.settings.to_dict()
