"""Classifier-free guidance as Diffusers' `ClassifierFreeGuidance` guider component (`guider/guider_config.json`),
which pipelines such as HunyuanVideo 1.5 load instead of taking a guidance scale argument.

The folder's guider fixes the formula (Diffusers' `uncond + s * (cond - uncond)`, or the paper's
`cond + s * (cond - uncond)`), the optional rescale of the guided prediction towards the conditional
one's standard deviation, and the default scale; a request may set its own scale. Only the settings
the family's real checkpoints use and diffserve reproduces are accepted: a CFG window (`start` / `stop`
other than 0 / 1) is refused at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffserve.models.config_keys import config_from_diffusers


@dataclass(frozen=True)
class ClassifierFreeGuidance:
    """The guider's settings (Diffusers' config keys and defaults) and its arithmetic, stateless per request."""

    diffusers_class_name: ClassVar[str] = "ClassifierFreeGuidance"

    guidance_scale: float = 7.5
    guidance_rescale: float = 0.0
    use_original_formulation: bool = False
    start: float = 0.0
    stop: float = 1.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if (self.start, self.stop) != (0.0, 1.0):
            raise ValueError(
                f"ClassifierFreeGuidance with start={self.start}, stop={self.stop} (CFG over part of the "
                "schedule) is not supported by diffserve; only start=0.0, stop=1.0"
            )
        if not 0.0 <= self.guidance_rescale <= 1.0:
            raise ValueError(f"guidance_rescale must be in [0, 1], got {self.guidance_rescale}")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ClassifierFreeGuidance:
        return config_from_diffusers(cls, config, cls.diffusers_class_name)

    @property
    def config(self) -> dict[str, Any]:
        return {
            "guidance_scale": self.guidance_scale,
            "guidance_rescale": self.guidance_rescale,
            "use_original_formulation": self.use_original_formulation,
            "start": self.start,
            "stop": self.stop,
            "enabled": self.enabled,
        }

    def runs_cfg(self, scale: float) -> bool:
        """Whether a request at `scale` runs the unconditional branch: the guider is enabled and the scale
        is not the one at which the formula returns the conditional prediction (1, or 0 for the paper's)."""
        neutral = 0.0 if self.use_original_formulation else 1.0
        return self.enabled and not math.isclose(scale, neutral)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided prediction of one request's rows (then rescaled, when the guider rescales)."""
        base = cond if self.use_original_formulation else uncond
        return self.rescaled(base + scale * (cond - uncond), cond)

    def rescaled(self, pred: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`pred` mixed with itself scaled to the conditional prediction's per-sample std by
        `guidance_rescale` (Diffusers applies it with and without the unconditional branch)."""
        if self.guidance_rescale <= 0.0:
            return pred
        dims = list(range(1, pred.ndim))
        ratio = cond.std(dim=dims, keepdim=True) / pred.std(dim=dims, keepdim=True)
        return self.guidance_rescale * (pred * ratio) + (1 - self.guidance_rescale) * pred
