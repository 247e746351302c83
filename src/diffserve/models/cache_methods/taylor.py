"""TaylorSeer's extrapolation (arXiv 2503.06923): predict a cached tensor at a later step from a Taylor
series whose derivatives are finite differences between the steps that computed it.

After computed values Y(s1), Y(s2), ... the series at the last computed step s holds Y(s) and its divided
differences up to `order`: dY = (Y(s) - Y(s')) / (s - s'), and so on for the higher orders. At a later
step t it predicts sum_i d^iY * (t - s)^i / i!. cache-dit's calibrator (DBCache's `enable_taylorseer`)
takes no difference before step 2 (`first_difference_step=2`); diffusers' hook from the second update.
"""

from __future__ import annotations

import math

import torch


class TaylorSeries:
    """One tensor stream's Taylor series (a residual, say), updated at computed steps."""

    def __init__(self, order: int, first_difference_step: int = 0) -> None:
        self.order = order
        self.first_difference_step = first_difference_step
        self.factors: list[torch.Tensor] = []
        self.last_step: int | None = None

    def update(self, value: torch.Tensor, step: int) -> None:
        """`value` computed at `step`: the new expansion point, with differences against the last one."""
        factors = [value]
        previous = self.factors
        if previous and previous[0].shape != value.shape:
            previous = []  # a new shape (another sequence length): restart the series
        if self.last_step is not None and step > self.last_step and step >= self.first_difference_step:
            window = step - self.last_step
            for i in range(min(self.order, len(previous))):
                factors.append((factors[i] - previous[i]) / window)
        self.factors = factors
        self.last_step = step

    def predict(self, step: int) -> torch.Tensor:
        """The series evaluated at `step` (RuntimeError before any update)."""
        if self.last_step is None:
            raise RuntimeError("TaylorSeer cannot predict before a step computed the value")
        elapsed = step - self.last_step
        out = self.factors[0]
        for i, factor in enumerate(self.factors[1:], start=1):
            out = out + factor * (elapsed**i / math.factorial(i))
        return out
