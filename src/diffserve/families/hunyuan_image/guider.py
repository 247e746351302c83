"""HunyuanImage 2.1's guider component: Diffusers' `AdaptiveProjectedMixGuidance` (`guider/guider_config.json`,
and `ocr_guider/` for prompts with quoted text), its settings and its arithmetic.

Per request and step `i` of `n` (the guider runs the negative branch at every step when it is enabled and
its CFG scale is not the neutral one, 1 or 0 with the paper's formula):

    i <= adaptive_projected_guidance_start_step   classic CFG at `guidance_scale`:
                                                  base + s * (cond - uncond), base = uncond (or cond)
                                                  and, with a momentum, m <- (cond - uncond) + momentum * m
    later steps (APG, unless its scale is neutral) m <- (cond - uncond) + momentum * m   (or m = the diff)
                                                  m scaled to a per-sample L2 norm of at most `rescale`,
                                                  split (in float64) into parts parallel / orthogonal to
                                                  cond; base + apg_scale * (orthogonal + eta * parallel)
    then, with guidance_rescale > 0, the result's per-sample std is pulled towards cond's.

The momentum buffer is the request's own (`HunyuanImageConditioning.momentum`), advanced with its steps, so
requests at different steps share a DiT batch. A CFG window (`start` / `stop` other than 0 / 1) is refused
at load, as for the other guiders diffserve reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from diffserve.models.config_keys import config_from_diffusers


@dataclass(frozen=True)
class AdaptiveProjectedMixGuidance:
    """The guider's settings (Diffusers' config keys and defaults) and its per-request arithmetic."""

    diffusers_class_name: ClassVar[str] = "AdaptiveProjectedMixGuidance"

    guidance_scale: float = 3.5
    guidance_rescale: float = 0.0
    adaptive_projected_guidance_scale: float = 10.0
    adaptive_projected_guidance_momentum: float | None = -0.5
    adaptive_projected_guidance_rescale: float = 10.0
    eta: float = 0.0
    use_original_formulation: bool = False
    start: float = 0.0
    stop: float = 1.0
    adaptive_projected_guidance_start_step: int = 5
    enabled: bool = True

    def __post_init__(self) -> None:
        if (self.start, self.stop) != (0.0, 1.0):
            raise ValueError(
                f"AdaptiveProjectedMixGuidance with start={self.start}, stop={self.stop} (guidance over part "
                "of the schedule) is not supported by diffserve; only start=0.0, stop=1.0"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AdaptiveProjectedMixGuidance:
        return config_from_diffusers(cls, config, cls.diffusers_class_name)

    @property
    def neutral_scale(self) -> float:
        """The scale at which a guidance formula returns the conditional prediction."""
        return 0.0 if self.use_original_formulation else 1.0

    def runs_cfg(self, scale: float) -> bool:
        """Whether a request at CFG scale `scale` runs the negative branch (at every step)."""
        return self.enabled and not math.isclose(scale, self.neutral_scale)

    def projects_at(self, step: int) -> bool:
        """Whether step `step` of a guided request uses APG rather than classic CFG."""
        return step > self.adaptive_projected_guidance_start_step and not math.isclose(
            self.adaptive_projected_guidance_scale, self.neutral_scale
        )

    def guide(
        self,
        cond: torch.Tensor,
        uncond: torch.Tensor,
        scale: float,
        step: int,
        momentum: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(guided prediction, the request's momentum after this step) of one request's rows at `step`;
        `scale` is the CFG scale, `momentum` the request's buffer (None: zero, or no momentum)."""
        diff = cond - uncond
        if self.adaptive_projected_guidance_momentum is not None:
            previous = 0.0 if momentum is None else self.adaptive_projected_guidance_momentum * momentum
            momentum = diff + previous
            diff = momentum
        base = cond if self.use_original_formulation else uncond
        if self.projects_at(step):
            pred = base + self.adaptive_projected_guidance_scale * self._projected(diff, cond)
        else:
            pred = base + scale * (cond - uncond)
        return self._rescaled(pred, cond), momentum

    def _projected(self, diff: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """APG's update: `diff` capped in norm, its part orthogonal to `cond` plus `eta` times the parallel
        part (the projection in float64, as Diffusers)."""
        dims = tuple(range(1, diff.ndim))
        threshold = self.adaptive_projected_guidance_rescale
        if threshold > 0:
            norm = diff.norm(p=2, dim=dims, keepdim=True)
            diff = diff * torch.minimum(torch.ones_like(diff), threshold / norm)
        v0 = diff.double()
        v1 = F.normalize(cond.double(), dim=dims)
        parallel = (v0 * v1).sum(dim=dims, keepdim=True) * v1
        orthogonal = v0 - parallel
        return orthogonal.type_as(diff) + self.eta * parallel.type_as(diff)

    def _rescaled(self, pred: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`pred` mixed with itself scaled to `cond`'s per-sample std by `guidance_rescale`."""
        if self.guidance_rescale <= 0.0:
            return pred
        dims = list(range(1, pred.ndim))
        ratio = cond.std(dim=dims, keepdim=True) / pred.std(dim=dims, keepdim=True)
        return self.guidance_rescale * (pred * ratio) + (1 - self.guidance_rescale) * pred
