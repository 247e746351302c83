"""SANA-Sprint's timestep preparation (Diffusers' SanaSprintPipeline): the SCM angles, the embedded guidance,
the initial latents scaled to TrigFlow's noise level, and the request's step noise, drawn from its
generator in Diffusers' order and moved to the device once."""

from __future__ import annotations

import torch

from diffserve.models.schedulers.scm import SCMScheduler
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.timestep_preparation import set_schedule


class SCMTimestepPreparationStage(Stage):
    needs = ("latents", "generator", "prompt_embeds")
    sets = ("schedule", "schedule.guidance", "scheduler_state")

    def __init__(
        self,
        scheduler: SCMScheduler,
        max_timesteps: float,
        intermediate_timesteps: float,
        guidance_embeds_scale: float,
    ) -> None:
        """`intermediate_timesteps` is the middle angle of two-step sampling (other step counts space
        their angles evenly, as Diffusers does without one)."""
        self.scheduler = scheduler
        self.max_timesteps = max_timesteps
        self.intermediate_timesteps = intermediate_timesteps
        self.guidance_embeds_scale = guidance_embeds_scale

    def forward(self, req: Req) -> Req:
        p = req.params
        steps = p.num_inference_steps
        intermediate = self.intermediate_timesteps if steps == 2 else None
        schedule = self.scheduler.schedule(steps, self.max_timesteps, intermediate)
        device = req.latents.device
        # Diffusers draws each step's noise after the initial latents, from the same generator.
        noise = self.scheduler.draw_noise(req.generator, steps, tuple(req.latents.shape))
        req.scheduler_state = self.scheduler.new_state(noise.to(device))
        # TrigFlow's sample at angle pi/2 is the noise at sigma_data.
        req.latents = req.latents * self.scheduler.config["sigma_data"]
        # As Diffusers: float32, then the text states' dtype, then the checkpoint's guidance scale.
        guidance = torch.full((req.batch_size,), float(p.guidance_scale), dtype=torch.float32, device=device)
        set_schedule(req, schedule, guidance.to(req.prompt_embeds.dtype) * self.guidance_embeds_scale)
        return req
