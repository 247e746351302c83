"""Wan 2.2 A14B's two experts: which DiT denoises a request's step.

The folder's `boundary_ratio` splits the schedule at `boundary_ratio * num_train_timesteps`: steps whose
timestep is at or above it run the high-noise expert (`transformer`, index 0), the rest the low-noise one
(`transformer_2`, index 1), with its own CFG scale (`guidance_scale_2`, default `guidance_scale`), as in
Diffusers. The engine asks for the expert of a request's next step when it groups requests (a request
batch key, evaluated every step), so the choice is made on the host: from the request's schedule,
recomputed on the CPU as the timestep stage computed it (no read of the device timesteps, no sync), once
per (steps, latent size).
"""

from __future__ import annotations

from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.request import Req

HIGH_NOISE, LOW_NOISE = 0, 1


class ExpertSwitch:
    def __init__(
        self, scheduler: FlowMatchEulerScheduler | UniPCFlowScheduler, patch_size: int, boundary_ratio: float
    ) -> None:
        self.scheduler = scheduler
        self.patch_size = patch_size
        self.boundary_timestep = boundary_ratio * scheduler.config["num_train_timesteps"]
        self._experts: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def experts(self, num_steps: int, latent_height: int, latent_width: int) -> tuple[int, ...]:
        """The expert of every step of a schedule (`DefaultTimestepPreparationStage`'s, same inputs)."""
        key = (num_steps, latent_height, latent_width)
        if key not in self._experts:
            mu = None
            if self.scheduler.config["use_dynamic_shifting"]:
                tokens = (latent_height // self.patch_size) * (latent_width // self.patch_size)
                mu = self.scheduler.resolution_shift_mu(tokens)
            timesteps = self.scheduler.schedule(num_steps, mu=mu).timesteps
            # Compared in the timesteps' float32, as Diffusers compares its timestep tensor.
            high = (timesteps >= self.boundary_timestep).tolist()
            self._experts[key] = tuple(HIGH_NOISE if h else LOW_NOISE for h in high)
        return self._experts[key]

    def expert(self, req: Req) -> int:
        """The expert of the request's next step."""
        assert req.latent_size is not None
        return self.experts(req.num_steps, *req.latent_size)[req.step_index]


def guidance_scale_of(req: Req, expert: int) -> float:
    """The request's CFG scale at a step of `expert`: `guidance_scale_2` (if set) for the low-noise one."""
    second = req.params.guidance_scale_2
    return float(second) if expert == LOW_NOISE and second is not None else req.cfg_scale
