"""SCM sampler for TrigFlow consistency models (Diffusers' `SCMScheduler`, what SANA-Sprint ships).

TrigFlow writes a noisy sample as `x_t = cos(t) x0 + sin(t) z` with angles `t` in [0, pi/2] and noise
`z ~ N(0, sigma_data^2)`. A consistency model predicts the clean sample in one go, so each step:

1. takes the model output `F` at angle `s` to the clean sample, `x0 = cos(s) x_s - sin(s) F`;
2. re-noises it to the next angle `t` with fresh noise, `x_t = cos(t) x0 + sin(t) z` (the last step ends
   at t = 0, where this is x0 itself).

The schedule is the angles from `max_timesteps` down to 0; Diffusers' SanaSprintPipeline puts its
`intermediate_timesteps` (1.3) between them for two steps. Diffusers draws each step's noise from the
pipeline's generator after the initial latents; here the scheduler holds configuration only and the
request's state carries its step noise, drawn in that order by timestep preparation and moved to the
device once (`new_state`), so a step makes no host transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffserve.models.config_keys import checked_config_kwargs
from diffserve.models.schedulers.flow_match_euler import SigmaSchedule
from diffserve.models.schedulers.step_order import checked_step_count

#: Diffusers' `SCMScheduler` config keys and their defaults.
SCM_CONFIG_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "trigflow",
    "sigma_data": 0.5,
}
#: Keys SANA's conversion script also writes (the released SANA-Sprint folders carry them). Diffusers'
#: scheduler does not take them and its pipeline passes its own defaults: accepted, recorded, unused.
SCM_IGNORED_KEYS = ("max_timesteps", "intermediate_timesteps")


@dataclass
class SCMState:
    """One request's step noise, (num_steps, batch, channels, h, w) in float32 on its latents' device,
    already scaled by sigma_data (row i is what Diffusers draws at step i), and the clean-sample
    prediction of its last step (`model_outputs[-1]`, what previews decode)."""

    noise: torch.Tensor
    model_outputs: list[torch.Tensor | None]
    last_step_index: int | None = None


class SCMScheduler:
    """TrigFlow consistency sampler. Stateless across requests."""

    diffusers_class_name: ClassVar[str] = "SCMScheduler"

    def __init__(
        self, num_train_timesteps: int = 1000, prediction_type: str = "trigflow", sigma_data: float = 0.5
    ):
        if prediction_type != "trigflow":
            raise ValueError(
                f"SCMScheduler supports prediction_type 'trigflow' only, got {prediction_type!r}"
            )
        self.config: dict[str, Any] = {
            "num_train_timesteps": num_train_timesteps,
            "prediction_type": prediction_type,
            "sigma_data": sigma_data,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SCMScheduler:
        """Build from a Diffusers `scheduler_config.json` dict; missing keys take Diffusers' defaults."""
        known = (*SCM_CONFIG_DEFAULTS, *SCM_IGNORED_KEYS)
        kwargs = checked_config_kwargs(config, known, cls.diffusers_class_name)
        ignored = {key: kwargs.pop(key) for key in SCM_IGNORED_KEYS if key in kwargs}
        scheduler = cls(**kwargs)
        scheduler.config.update(ignored)
        return scheduler

    def schedule(
        self, num_steps: int, max_timesteps: float, intermediate_timesteps: float | None = None
    ) -> SigmaSchedule:
        """The angles of `num_steps` steps (the final 0 appended, as `sigmas`; without it, as `timesteps`),
        as Diffusers' `set_timesteps`: `[max, intermediate, 0]` for two steps with `intermediate_timesteps`,
        else a float32 linspace from `max_timesteps` to 0."""
        if not 1 <= num_steps <= self.config["num_train_timesteps"]:
            raise ValueError(
                f"num_steps must be in [1, {self.config['num_train_timesteps']}], got {num_steps}"
            )
        if intermediate_timesteps is not None:
            if num_steps != 2:
                raise ValueError("SCM's intermediate timestep applies to two-step sampling only")
            angles = torch.tensor([max_timesteps, intermediate_timesteps, 0]).float()
        else:
            angles = torch.linspace(max_timesteps, 0, num_steps + 1).float()
        return SigmaSchedule(sigmas=angles, timesteps=angles[:-1].clone())

    def draw_noise(self, generator: torch.Generator, num_steps: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Every step's noise for one request, in Diffusers' order (one `randn` of the latents' shape per
        step, from the request's CPU generator, after its initial latents), scaled by sigma_data."""
        draws = [torch.randn(shape, generator=generator, device="cpu") for _ in range(num_steps)]
        return torch.stack(draws) * self.config["sigma_data"]

    def new_state(self, noise: torch.Tensor | None = None) -> SCMState:
        """A request's state holding its step noise (`draw_noise`, on the latents' device)."""
        if noise is None:
            raise ValueError("SCM needs the request's step noise: timestep preparation makes its state")
        return SCMState(noise=noise, model_outputs=[None])

    def step(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        step_index: int,
        state: SCMState,
        host_sigmas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Advance one request's rows from angle `sigmas[step_index]` to `sigmas[step_index + 1]` (the
        request's angles on the sample's device, where Diffusers keeps its timesteps; `host_sigmas` is
        part of the engine's step contract and not read). Calls must use consecutive step indices."""
        checked_step_count("SCM", sigmas, step_index, state.last_step_index)
        s, t = sigmas[step_index], sigmas[step_index + 1]
        pred_x0 = torch.cos(s) * sample - torch.sin(s) * model_output
        state.model_outputs = [pred_x0]
        state.last_step_index = step_index
        return torch.cos(t) * pred_x0 + torch.sin(t) * state.noise[step_index]

    #: The engine's per-request step entry point (`cfg_batch.advance_requests`).
    step_request = step
