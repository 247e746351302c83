"""EasyCache (arXiv 2507.02860), per request: runtime-adaptive reuse with no model-specific data.

Between two steps that ran the blocks, the blocks' transformation rate is measured,
k = mean |out_t - out_s| / mean |in_t - in_s| (`in`: the blocks' input, `out`: their output). On a later
step, the input's change since the last computed step, scaled by k and by the last output's magnitude,
estimates the relative change of the output: k * mean |in - in_s| / mean |out_s|. These estimates add up
from step to step; while their sum stays below `reuse_threshold` the blocks' last residual is reused, else
the step computes and the sum restarts. The steps before `start_percent` and from `end_percent` of the
steps on always compute, as does every step until k is known (two computed steps after the warm-up).

EasyCache measures the model's input and output (latents); here the cache sits around the DiT's blocks,
so it measures the blocks' input (the embedded tokens, what the batch hands every method as the span's
input: the probe "input") and output, the same quantities one linear layer inside the model. The
estimates stay 0-d tensors until the batch fetches every request's decision value in one transfer.
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.configs.cache_settings import EasyCacheSettings
from diffserve.models.cache_methods.base import CachedResidual, Plan
from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.cache_methods.residual_state import AccumulatedChange, CachedResidualState


def _mean_abs_change(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    return (current - previous).abs().mean()


class EasyCacheState(CachedResidualState):
    method = "easycache"
    probe = "input"

    def __init__(self, settings: EasyCacheSettings, num_blocks: int) -> None:
        super().__init__(num_blocks, CachedResidual())
        self.settings = settings
        #: The blocks' input and output at the last computed step, and the output's mean magnitude.
        self.input_prev: torch.Tensor | None = None
        self.output_prev: torch.Tensor | None = None
        self.output_norm: torch.Tensor | None = None
        #: The transformation rate k (0-d), known after two computed steps with the same shapes.
        self.rate: torch.Tensor | None = None
        #: This step's input while it computes (k and the references are updated when it stores).
        self.pending_input: torch.Tensor | None = None
        self.accumulated = AccumulatedChange()

    @property
    def kept_states(self) -> int:
        return 3  # the residual, the last computed input and output

    def plan(self, step: int, num_steps: int) -> Plan:
        s = self.settings
        if step < int(s.start_percent * num_steps + 0.5) or step >= int(s.end_percent * num_steps + 0.5):
            return Plan.COMPUTE
        if self.rate is None or not self.cached.present:
            return Plan.COMPUTE
        return Plan.MEASURE

    def measure(self, probe: torch.Tensor) -> torch.Tensor | None:
        """The estimated relative change of the output: k * mean |in - in_s| / mean |out_s|."""
        if self.input_prev is None or self.input_prev.shape != probe.shape:
            return None
        assert self.rate is not None and self.output_norm is not None, "planned MEASURE only once k is known"
        return self.rate * _mean_abs_change(probe, self.input_prev) / self.output_norm.clamp_min(1e-12)

    def decide(self, change: float | None, step: int, num_steps: int) -> bool:
        return self.accumulated.reuses(change, self.settings.reuse_threshold)

    def keep_probe(self, probe: torch.Tensor, reused: bool) -> None:
        self.pending_input = None if reused else probe.detach()

    def store(self, residual: Streams, step: int) -> None:
        """A computed step: its residual, and from its input and output the new k and references."""
        super().store(residual, step)
        if self.pending_input is None:
            raise RuntimeError("easycache stores a step whose input it was not given (probe 'input')")
        current_in = self.pending_input
        current_out = current_in + residual.image.detach()
        comparable = self.input_prev is not None and self.input_prev.shape == current_in.shape
        if comparable:
            assert self.output_prev is not None
            input_change = _mean_abs_change(current_in, self.input_prev).clamp_min(1e-12)
            self.rate = _mean_abs_change(current_out, self.output_prev) / input_change
        else:
            self.rate = None
        self.input_prev, self.output_prev = current_in, current_out
        self.output_norm = current_out.abs().mean()
        self.pending_input = None

    def settings_report(self) -> dict[str, Any]:
        return self.settings.to_dict()
