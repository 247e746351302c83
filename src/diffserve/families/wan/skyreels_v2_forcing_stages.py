"""SkyReels-V2 diffusion forcing's preparation: the first window's noise, and the request's plan (the rows
of every window) with its schedule of one row a step."""

from __future__ import annotations

import torch

from diffserve.families.wan.skyreels_v2_forcing_plan import forcing_plan, row_step_indices
from diffserve.families.wan.skyreels_v2_forcing_settings import (
    causal_block,
    request_windows,
    skyreels_v2_df_settings,
)
from diffserve.families.wan.skyreels_v2_forcing_state import (
    ForcingProgress,
    SkyReelsV2ForcingConditioning,
    addnoise_seed,
)
from diffserve.models.schedulers.flow_match_euler import SigmaSchedule
from diffserve.request import LatentSize, Req
from diffserve.stages.latent_preparation import VideoLatentPreparationStage, initial_noise
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage, set_schedule


def image_latents(req: Req) -> torch.Tensor | None:
    """Image-to-video: the input image's latents (batch, channels, 1, h, w), which start the first window."""
    return SkyReelsV2ForcingConditioning.of(req).condition_latents


class SkyReelsV2ForcingLatentStage(VideoLatentPreparationStage):
    """The first window's noise (every latent frame of a one-window video, `base_num_frames`' of a long
    one), drawn as Diffusers does, with an input image's latents (rounded to the DiT's dtype, as Diffusers
    writes them) in place of its first frame; the next windows draw theirs from the same generator when they
    start."""

    #: The DiT's frames per causal block and its dtype, set by the pipeline.
    dit_frames_per_block: int = 1
    dit_dtype: torch.dtype = torch.float32

    def forward(self, req: Req) -> Req:
        p = req.params
        settings = skyreels_v2_df_settings(p)
        block = causal_block(settings, self.dit_frames_per_block)
        frames = request_windows(p, settings, self.temporal, block)[0].frames
        h, w = p.height // self.spatial, p.width // self.spatial
        shape = (p.num_outputs_per_prompt, self.channels, frames, h, w)
        latents = initial_noise(req, shape, self.dtype).to(self.device)
        image = image_latents(req)
        if image is not None:
            latents[:, :, : image.shape[2]] = image.to(self.dit_dtype)
        req.latents = latents
        req.latent_size = LatentSize(h, w)
        return req


class SkyReelsV2ForcingTimestepStage(DefaultTimestepPreparationStage):
    """The scheduler's schedule (which each frame runs), the request's plan over it, and the request's
    `Schedule` of one row a step (each row at its least advanced stepped frame's sigma)."""

    needs = ("latents", "latent_size")
    sets = (
        "schedule",
        "conditioning.causal_block_size",
        "conditioning.plan",
        "conditioning.frame_schedule",
        "conditioning.ar_step",
        "conditioning.addnoise_condition",
        "conditioning.progress",
    )  # and conditioning.addnoise_generator, with addnoise_condition > 0 and frames to continue from

    #: The DiT's frames per causal block and the VAE's temporal factor, set by the pipeline.
    dit_frames_per_block: int = 1
    temporal: int = 4

    def forward(self, req: Req) -> Req:
        super().forward(req)  # the scheduler's schedule, as the synchronous pipelines take it
        frame_schedule = req.schedule
        assert frame_schedule is not None
        settings = skyreels_v2_df_settings(req.params)
        block = causal_block(settings, self.dit_frames_per_block)
        image = image_latents(req)
        first_prefix = 0 if image is None else int(image.shape[2])
        windows = request_windows(req.params, settings, self.temporal, block, first_prefix)
        host_timesteps = frame_schedule.timesteps.cpu()
        plan = forcing_plan(windows, host_timesteps, settings.ar_step, block, req.latents.device)
        rows = row_step_indices(plan)
        host_sigmas = frame_schedule.host_sigmas
        set_schedule(
            req,
            SigmaSchedule(
                sigmas=torch.cat([host_sigmas[rows], host_sigmas[-1:]]), timesteps=host_timesteps[rows]
            ),
        )
        conditioning = SkyReelsV2ForcingConditioning.of(req)
        conditioning.causal_block_size = block
        conditioning.plan = plan
        conditioning.frame_schedule = frame_schedule
        conditioning.ar_step = settings.ar_step
        conditioning.addnoise_condition = settings.addnoise_condition
        if settings.addnoise_condition > 0 and any(window.prefix for window in windows):
            generator = torch.Generator(req.latents.device)
            conditioning.addnoise_generator = generator.manual_seed(addnoise_seed(req.params.seed))
        conditioning.progress = ForcingProgress(states=[None] * len(plan.windows[0].groups))
        return req
