"""FasterCache's stand-in for a CFG request's unconditional (negative-prompt) branch, decided and computed
as diffusers' `FasterCacheDenoiserHook` (with `is_guidance_distilled` False) does.

Per request: its first step, every `unconditional_batch_skip_range`-th step and every step whose timestep
lies outside `low < t < high` (`unconditional_batch_timestep_skip_range`) run both branches, and keep the
difference negative - positive of their predictions, split into a low- and a high-frequency part of the
2-D spectrum over the latent's spatial dimensions. Any other step runs the prompt branch alone; the
negative prediction is the prompt's with the kept differences added back, each difference first scaled
by its `alpha_*_frequency` when the step's timestep lies in that part's update range (the scaled
difference is kept: the scales compound over consecutive skipped steps, as diffusers' hook does).

The predictions are given on their spatial grid, (..., height, width) (`pipelines/cfg_batch.py` unpacks
a family's packed tokens); the spectrum is taken over the last two dimensions of each row, in float32.
"""

from __future__ import annotations

import torch

from diffserve.configs.cache_settings import FasterCacheSettings, within_timesteps


def split_frequencies(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high): `x`'s centred 2-D spectrum over its last two dimensions, in float32, split by the disc
    of radius min(height, width) // 5 around its centre (low inside, high outside; their sum is the
    spectrum)."""
    spectrum = torch.fft.fftshift(torch.fft.fft2(x.float()), dim=(-2, -1))
    height, width = x.shape[-2:]
    radius = min(height, width) // 5
    rows = torch.arange(height, device=x.device)[:, None]
    cols = torch.arange(width, device=x.device)[None, :]
    low = (cols - width // 2) ** 2 + (rows - height // 2) ** 2 <= radius**2
    return spectrum * low, spectrum * ~low


def join_frequencies(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """The real signal whose centred spectrum is `low + high` (inverse of `split_frequencies`)."""
    return torch.fft.ifft2(torch.fft.ifftshift(low + high, dim=(-2, -1))).real


class UnconditionalBranch:
    """One CFG request's unconditional-branch approximation: which steps skip that branch, and the
    frequency-split branch difference standing in for it."""

    def __init__(self, settings: FasterCacheSettings) -> None:
        self.settings = settings
        #: Denoiser forwards (steps) decided so far.
        self.forwards = 0
        #: Whether this step runs the prompt branch alone.
        self.skipping = False
        #: Steps that ran the prompt branch alone.
        self.skipped = 0
        self._low: torch.Tensor | None = None
        self._high: torch.Tensor | None = None

    def decide(self, timestep: float) -> bool:
        """Whether this step (at `timestep`) runs the prompt branch alone; called once per step, before
        the step's DiT batch is built."""
        s = self.settings
        self.skipping = (
            self.forwards > 0
            and within_timesteps(timestep, s.unconditional_batch_timestep_skip_range)
            and self.forwards % s.unconditional_batch_skip_range != 0
        )
        self.forwards += 1
        self.skipped += self.skipping
        return self.skipping

    def keep_difference(self, positive: torch.Tensor, negative: torch.Tensor) -> None:
        """Keep negative - positive, per frequency part, from a step that ran both branches."""
        low_negative, high_negative = split_frequencies(negative)
        low_positive, high_positive = split_frequencies(positive)
        self._low = low_negative - low_positive
        self._high = high_negative - high_positive

    def approximate(self, positive: torch.Tensor, timestep: float) -> torch.Tensor:
        """The negative branch's prediction standing in for it at this skipped step, from the prompt
        branch's `positive` (in its dtype)."""
        if self._low is None or self._high is None:
            raise RuntimeError("fastercache: no branch difference kept before a skipped step")
        s = self.settings
        self._low = self._low * (
            s.alpha_low_frequency
            if within_timesteps(timestep, s.low_frequency_weight_update_timestep_range)
            else 1.0
        )
        self._high = self._high * (
            s.alpha_high_frequency
            if within_timesteps(timestep, s.high_frequency_weight_update_timestep_range)
            else 1.0
        )
        low_positive, high_positive = split_frequencies(positive)
        negative = join_frequencies(self._low + low_positive, self._high + high_positive)
        return negative.to(positive.dtype)
