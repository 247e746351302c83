"""HiDream-I1's own stages: its size rule at validation and its timestep rule.

- Text length: `max_sequence_length` at least `min_max_sequence_length` (2; see the config).
- Size: Diffusers rescales every request to the area of its default size (`default_sample_size` latent
  pixels per side times the VAE's factor: 1024 x 1024 with the 8x VAE), keeping the aspect ratio, each side
  floored to a multiple of twice the VAE's factor; the output has that size. Validation applies the rule
  once (a request's height and width become the sizes it generates), with the default size for a side the
  request leaves unset. A non-square size whose grid has more DiT patches than the DiT pads to (its
  `max_resolution` area in patches) is refused: Diffusers fails on it in the DiT (none released: their
  `max_resolution` covers the default area).
- Timesteps: the folder's scheduler's own schedule. Flow-matching Euler gets `mu` from Diffusers'
  default shift line at the DiT's `max_seq` (used only when the scheduler shifts dynamically); UniPC gets
  the step count alone, as Diffusers calls it.
"""

from __future__ import annotations

from dataclasses import replace

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.hidream.config import HiDreamPipelineConfig, rescaled_size, schedule_shift_mu
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.input_validation import InputValidationStage
from diffserve.stages.timestep_preparation import set_schedule


class HiDreamInputValidationStage(InputValidationStage):
    """The shared validation, after Diffusers' size rule (module docstring)."""

    def __init__(
        self,
        *,
        vae_scale_factor: int,
        default_sample_size: int,
        min_max_sequence_length: int,
        max_patches: int,
        **options,
    ) -> None:
        super().__init__(**options)
        self.max_side = default_sample_size * vae_scale_factor
        self.division = vae_scale_factor * 2
        self.min_max_sequence_length = min_max_sequence_length
        #: The patches the DiT pads a non-square grid to (its `max_seq`).
        self.max_patches = max_patches

    def resolve(self, params: SamplingParams) -> SamplingParams:
        length, least = params.max_sequence_length, self.min_max_sequence_length
        if isinstance(length, int) and not isinstance(length, bool) and 0 < length < least:
            raise InvalidRequestError(
                f"max_sequence_length must be at least {least} for HiDream-I1, got {length}: its CLIP "
                f"tokenizers add {least} special tokens and cannot truncate a prompt to fewer",
                param="max_sequence_length",
            )
        height = self.max_side if params.height is None else params.height
        width = self.max_side if params.width is None else params.width
        if not all(isinstance(side, int) and side > 0 for side in (height, width)):
            return super().resolve(params)  # the shared validation names the bad field
        rescaled = rescaled_size(height, width, self.max_side, self.division)
        for name, side in zip(("height", "width"), rescaled, strict=True):
            if side % self.pixel_multiple:  # only a DiT with patches larger than 2 (none released)
                raise InvalidRequestError(
                    f"HiDream-I1 generates {rescaled[0]}x{rescaled[1]} for {height}x{width} (Diffusers' area "
                    f"rule), and its {name} is not a multiple of {self.pixel_multiple} (this DiT's patch in "
                    "pixels): ask for another aspect ratio",
                    param=name,
                )
        self._check_padded_grid(height, width, *rescaled)
        return super().resolve(replace(params, height=rescaled[0], width=rescaled[1]))

    def _check_padded_grid(self, height: int, width: int, out_height: int, out_width: int) -> None:
        """A non-square grid is padded to `max_patches` DiT patches: it must not have more."""
        patches = (out_height // self.pixel_multiple) * (out_width // self.pixel_multiple)
        if out_height != out_width and patches > self.max_patches:
            raise InvalidRequestError(
                f"HiDream-I1 generates {out_height}x{out_width} for {height}x{width} (Diffusers' area rule): "
                f"{patches} DiT patches, more than the {self.max_patches} this DiT pads a non-square image to "
                "(its max_resolution); ask for a square image",
                param="height",
            )


def check_unipc_shift(scheduler: FlowMatchEulerScheduler | UniPCFlowScheduler) -> None:
    """ModelLoadError for a UniPC scheduler with `use_dynamic_shifting`: Diffusers' pipeline sets UniPC's
    timesteps from the step count alone (no `mu`), which such a scheduler refuses at every request."""
    if isinstance(scheduler, UniPCFlowScheduler) and scheduler.config["use_dynamic_shifting"]:
        raise ModelLoadError(
            "this HiDream-I1 folder's UniPCMultistepScheduler sets use_dynamic_shifting=True, but the pipeline "
            "(as Diffusers') gives UniPC no resolution shift mu, so no request could run (Diffusers raises "
            "at every call): set use_dynamic_shifting to false (the static flow_shift applies)"
        )


class HiDreamTimestepPreparationStage(Stage):
    needs = ("latents",)
    sets = ("schedule",)

    def __init__(
        self,
        scheduler: FlowMatchEulerScheduler | UniPCFlowScheduler,
        max_seq: int,
        config: HiDreamPipelineConfig,
    ) -> None:
        self.scheduler = scheduler
        self.mu = schedule_shift_mu(config, max_seq)

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        if isinstance(self.scheduler, UniPCFlowScheduler):
            schedule = self.scheduler.schedule(steps)
        else:
            schedule = self.scheduler.schedule(steps, mu=self.mu)
        set_schedule(req, schedule)
        return req
