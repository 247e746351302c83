"""One diffusion-forcing step of one request: its DiT inputs for the step's row, and the update of the row's
stepped frame groups, each with its own scheduler state, then, after a window's last row, the next window's
latents (or, after the last, the whole video's)."""

from __future__ import annotations

import torch

from diffserve.families.wan.skyreels_v2_forcing_plan import WindowPlan
from diffserve.families.wan.skyreels_v2_forcing_state import (
    ForcingProgress,
    FrameScheduler,
    SkyReelsV2ForcingConditioning,
)
from diffserve.models.schedulers.unipc_flow import UniPCState
from diffserve.request import Req


def current_row(req: Req) -> tuple[SkyReelsV2ForcingConditioning, int, WindowPlan, int]:
    """The request's conditioning, and the window (index and plan) and row of its next step."""
    conditioning = SkyReelsV2ForcingConditioning.of(req)
    assert conditioning.plan is not None, "diffusion-forcing timestep preparation has not run"
    index, row = conditioning.plan.locate(req.step_index)
    return conditioning, index, conditioning.plan.windows[index], row


def forcing_inputs(req: Req, dit_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT's input latents (the window, with `addnoise_condition` the prefix frames noised anew, as
    Diffusers does in the DiT's dtype at every step) and (batch, frames) per-frame timesteps (the prefix's
    at `addnoise_condition`, truncated to an integer as Diffusers' int64 timesteps hold it)."""
    conditioning, _, window, row = current_row(req)
    timesteps = window.timesteps[row]
    prefix = window.shape.prefix
    latents = req.latents
    if prefix and conditioning.addnoise_condition > 0:
        factor = 0.001 * conditioning.addnoise_condition
        latents = latents.to(dit_dtype).clone()
        kept = latents[:, :, :prefix]
        noise = torch.randn(
            kept.shape, generator=conditioning.addnoise_generator, device=kept.device, dtype=kept.dtype
        )
        latents[:, :, :prefix] = kept * (1.0 - factor) + noise * factor
        timesteps = timesteps.clone()
        timesteps[:prefix] = float(int(conditioning.addnoise_condition))
    return latents, timesteps.expand(req.batch_size, -1)


def advance_forcing(
    scheduler: FrameScheduler, req: Req, prediction: torch.Tensor, dit_dtype: torch.dtype
) -> None:
    """Step every frame group the row updates at its own scheduler step (its progress - 1) along the frames'
    schedule, keep the others, then move to the next step (and window)."""
    conditioning, index, window, row = current_row(req)
    progress, schedule = conditioning.progress, conditioning.frame_schedule
    assert progress is not None and schedule is not None
    pieces = []
    last_state = None
    for number, group in enumerate(window.groups):
        sample = req.latents[:, :, group.start : group.stop]
        if not window.updated[row][group.start]:
            pieces.append(sample)
            continue
        step = window.progress[row][group.start] - 1
        if step == 0:
            progress.states[number] = scheduler.new_state()
        state = progress.states[number]
        stepped = scheduler.step_request(
            prediction[:, :, group.start : group.stop],
            sample,
            schedule.sigmas,
            step,
            state,
            schedule.host_sigmas,
        )
        if isinstance(state, UniPCState) and state.last_sample is sample:
            # Diffusers steps each frame's scheduler on a view of its latents' frame and writes the result
            # back into it, so a remembered sample that no corrector replaced is the step's output.
            state.last_sample = stepped
        pieces.append(stepped)
        if last_state is None:
            last_state = state
    req.latents = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    req.last_prediction = prediction
    # Previews read the data prediction of the earliest frames this step moved.
    req.scheduler_state = last_state
    req.step_index += 1
    if row == window.rows - 1:
        _finish_window(req, conditioning, progress, index, dit_dtype)


def _finish_window(
    req: Req,
    conditioning: SkyReelsV2ForcingConditioning,
    progress: ForcingProgress,
    index: int,
    dit_dtype: torch.dtype,
) -> None:
    """Append the finished window to the video; start the next window from fresh noise with the video's
    frames as its prefix (Diffusers' `prepare_latents`), or, after the last, leave the whole video's latents."""
    assert conditioning.plan is not None
    windows = conditioning.plan.windows
    window = windows[index]
    if progress.video is None:
        progress.video = req.latents
    else:
        progress.video = torch.cat([progress.video, req.latents[:, :, window.shape.overlap :]], dim=2)
    if index + 1 == len(windows):
        req.latents = progress.video
        return
    following = windows[index + 1].shape
    batch, channels, _, height, width = req.latents.shape
    noise = torch.randn(
        (batch, channels, following.frames, height, width),
        generator=req.generator,
        device="cpu",
        dtype=req.latents.dtype,
    ).to(req.latents.device)
    start = progress.video.shape[2] - following.overlap
    noise[:, :, : following.prefix] = progress.video[:, :, start : start + following.prefix].to(dit_dtype)
    req.latents = noise
    progress.states = [None] * len(windows[index + 1].groups)
