"""Timestep preparation: a request's sigma schedule, computed on the CPU as Diffusers does and moved to
the latents' device once, so no step makes a (synchronous) host-to-device copy."""

from __future__ import annotations

import numpy as np
import torch

from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler, SigmaSchedule
from diffserve.request import Req, Schedule
from diffserve.stages.base import Stage


def set_schedule(req: Req, schedule: SigmaSchedule, guidance: torch.Tensor | None = None) -> None:
    """The request's schedule on its latents' device, with the CPU copy of its sigmas kept for the host,
    and the (batch,) guidance its DiT embeds, if it takes one."""
    device = req.latents.device
    req.schedule = Schedule(
        sigmas=schedule.sigmas.to(device),
        timesteps=schedule.timesteps.to(device),
        host_sigmas=schedule.sigmas,
        host_timesteps=schedule.timesteps,
        guidance=guidance,
    )
    req.step_index = 0


def embedded_guidance(req: Req) -> torch.Tensor:
    """The request's guidance scale, once per output, float32 on the latents' device: what a DiT with
    guidance embedding (FLUX.1, FLUX.2-dev) takes at every step."""
    return torch.full(
        (req.batch_size,), float(req.params.guidance_scale), dtype=torch.float32, device=req.latents.device
    )


class TimestepPreparationStage(Stage):
    """FLUX semantics: sigmas linspace(1, 1/n) shifted by `mu` from the packed image token count."""

    needs = ("latents",)
    sets = ("schedule",)

    def __init__(self, scheduler: FlowMatchEulerScheduler, guidance_embeds: bool) -> None:
        self.scheduler = scheduler
        self.guidance_embeds = guidance_embeds

    def shift_mu(self, image_seq_len: int, steps: int) -> float:
        """The schedule's shift for `image_seq_len` packed image tokens: the scheduler's resolution shift
        (a family with another rule overrides this)."""
        return self.scheduler.resolution_shift_mu(image_seq_len)

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        mu = self.shift_mu(int(req.latents.shape[1]), steps)
        base_sigmas = np.linspace(1.0, 1 / steps, steps)
        guidance = embedded_guidance(req) if self.guidance_embeds else None
        set_schedule(req, self.scheduler.schedule(steps, mu=mu, sigmas=base_sigmas), guidance)
        return req


class DefaultTimestepPreparationStage(Stage):
    """SD3 semantics: the scheduler's own schedule (static shift, or resolution shift when dynamic).

    `resolution_shift` False: no mu whatever the scheduler's `use_dynamic_shifting`, for pipelines whose
    Diffusers counterpart passes none (SANA's: its DPM-Solver then keeps its static `flow_shift`)."""

    needs = ("latents", "latent_size")
    sets = ("schedule",)

    def __init__(
        self, scheduler: FlowMatchEulerScheduler, patch_size: int, *, resolution_shift: bool = True
    ) -> None:
        self.scheduler = scheduler
        self.patch_size = patch_size
        self.resolution_shift = resolution_shift

    def forward(self, req: Req) -> Req:
        mu = None
        if self.resolution_shift and self.scheduler.config["use_dynamic_shifting"]:
            height, width = req.latent_size
            tokens = (height // self.patch_size) * (width // self.patch_size)
            mu = self.scheduler.resolution_shift_mu(tokens)
        set_schedule(req, self.scheduler.schedule(req.params.num_inference_steps, mu=mu))
        return req
