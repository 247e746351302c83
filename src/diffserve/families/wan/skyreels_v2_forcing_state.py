"""What a SkyReels-V2 diffusion-forcing request carries beyond Wan's conditioning: its plan (windows and
step matrices), the frames' own schedule, and the per-group scheduler states and finished frames its steps
advance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
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
class WindowDecode:
    """A streamed request's decode of its finished latent frames while it denoises
    (`skyreels_v2_forcing_decode.py`): the VAE's causal cache over the frames decoded so far (a
    `CausalCache`, on the VAE's device), how many latent frames that is, and their frames as the output
    has them, one uint8 (frames, H, W, 3) host array per latent frame (`video_to_uint8` is elementwise, so
    converting a chunk gives exactly its frames of the whole clip), which the final decode joins to the
    rest."""

    cache: object
    frames: int = 0
    pixels: list[np.ndarray] = field(default_factory=list)
    #: Set when a decode between steps failed: no more are tried, and the final decode decodes the whole
    #: clip without handing out the chunks already streamed again.
    failed: bool = False


@dataclass(eq=False)
class ForcingProgress:
    """What the steps advance besides the latents: a scheduler state per frame group of the current window
    (None until the group's first step), the video's finished latent frames (previous windows'), and, for a
    streamed request, the decode of those frames so far (None until its first frame is decoded)."""

    states: list[object | None]
    video: torch.Tensor | None = None
    decoded: WindowDecode | None = None


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
    #: The output video's frames before its decoded latents, (1, 3, frames, H, W) float32 in [-1, 1]
    #: (video-to-video: every input frame at the output size, `skyreels_v2_v2v.py`); None: the output is
    #: the decoded latents alone. Final pixels from the start: a streamed request publishes them first.
    leading_pixels: torch.Tensor | None = None
    #: Whether a streamed request's `leading_pixels` were handed out (once, before any decoded frame).
    leading_published: bool = False
