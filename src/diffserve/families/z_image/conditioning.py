"""`ZImageConditioning`: what a Z-Image request carries beyond `Req`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class ZImageConditioning(Conditioning):
    """Set by Z-Image's timestep preparation."""

    #: The DiT's own time axis, 1 - t / 1000 (computed on the CPU as Diffusers does, then moved with the
    #: schedule), one entry per step on the latents' device; cut with the schedule by image-to-image.
    dit_timesteps: torch.Tensor | None = field(default=None, metadata=role(per_step=True))
    #: The CFG scale of each step, on the host: the request's guidance scale, 0.0 at the steps
    #: `cfg_truncation` drops CFG at (`config.cfg_truncated`); cut with the schedule by image-to-image.
    cfg_scales: list[float] | None = field(default=None, metadata=role(per_step=True))
    #: The request's `cfg_normalization` (0.0: off): the guided prediction's norm is capped at this
    #: multiple of the prompt branch's.
    cfg_normalization: float | None = None
