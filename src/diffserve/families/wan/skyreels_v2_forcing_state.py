"""What a SkyReels-V2 diffusion-forcing request carries beyond Wan's conditioning: its plan (windows and
step matrices), the frames' own schedule, and the per-group scheduler states and finished frames its steps
advance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from diffserve.families.wan.conditioning import WanConditioning
from diffserve.families.wan.skyreels_v2_forcing_plan import ForcingPlan
from diffserve.request import Schedule, role

#: Added to a request's seed for the generator of `addnoise_condition`'s noise, which Diffusers draws from the
#: global RNG (`torch.randn_like`): a generator of its own keeps a seed's video reproducible without
#: repeating the initial noise's numbers.
ADDNOISE_SEED_OFFSET = 0x5EED


def addnoise_seed(seed: int) -> int:
    """The seed of a request's `addnoise_condition` generator (on its latents' device)."""
    return (int(seed) + ADDNOISE_SEED_OFFSET) % 2**63


class FrameScheduler(Protocol):
    """The engine's per-request scheduler contract (`UniPCFlowScheduler`, `FlowMatchEulerScheduler`), used
    here once per frame group."""

    def new_state(self) -> object: ...

    def step_request(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        step_index: int,
        state: object,
        host_sigmas: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(eq=False)
class ForcingProgress:
    """What the steps advance besides the latents: a scheduler state per frame group of the current window
    (None until the group's first step) and the video's finished latent frames (previous windows')."""

    states: list[object | None]
    video: torch.Tensor | None = None


@dataclass
class SkyReelsV2ForcingConditioning(WanConditioning):
    """Set by `SkyReelsV2ForcingTimestepStage`; requests in one DiT batch share the causal block (the DiT's
    block-causal attention is one mask a call)."""

    causal_block_size: int | None = field(default=None, metadata=role(batch="value"))
    plan: ForcingPlan | None = None
    #: The scheduler's own schedule, which every frame runs (the request's `Schedule` has one row a step).
    frame_schedule: Schedule | None = None
    ar_step: int = 0
    addnoise_condition: float = 0.0
    #: With `addnoise_condition` > 0 and frames to continue from (a long video's next windows, an input
    #: image): the noise given to a window's prefix at every step.
    addnoise_generator: torch.Generator | None = None
    progress: ForcingProgress | None = field(default=None, metadata=role(stepped=True))
