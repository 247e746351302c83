"""SkyReels-V2 diffusion forcing's schedule of one request: its windows and each window's step matrix.

Diffusers' `SkyReelsV2DiffusionForcingPipeline` denoises a video in windows of at most `base_num_frames`
frames (one window unless `num_frames` exceeds it and `overlap_history` is set), each window after the first
starting from the previous one's last latent frames. Within a window the latent frames are grouped in causal
blocks, and each block moves along the scheduler's timesteps at its own pace (`generate_timestep_matrix`):
every iteration is a row giving each block a progress, 0 before its first step, `k` (1..steps) at the
scheduler's `k`-th timestep, steps + 1 once done; a block lags `ar_step` steps behind the one before it until
that one is done (`ar_step` 0: every block in step), and a block is stepped at a row only if its progress
moved there and it is not done. The DiT sees the whole window at every row, each frame at its block's
timestep (999 before its first step, 0 once done).

Here one row is one engine step, so a request's steps are the rows of all its windows in turn. Blocks whose
columns are equal in every row of a window never part: they are one `FrameGroup` with one scheduler state
(in the synchronous mode a window is one group, stepped as one tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Diffusers' timestep for a block that has not taken its first step (its template's leading dummy).
NOT_STARTED_TIMESTEP = 999


@dataclass(frozen=True)
class WindowShape:
    """One window in latent frames: `frames` denoised together, of which the leading `prefix` come
    already denoised from the previous window (never stepped), and the leading `overlap` are frames the
    video already has (dropped when the window's frames are appended; `prefix` <= `overlap`)."""

    frames: int
    prefix: int = 0
    overlap: int = 0


def window_shapes(
    latent_frames: int,
    block: int,
    base_latent_frames: int | None = None,
    overlap_latent_frames: int | None = None,
    first_prefix: int = 0,
) -> tuple[WindowShape, ...]:
    """The windows of a video of `latent_frames` (Diffusers' long-video iterations and `prepare_latents`).

    One window of every frame unless `base_latent_frames` and `overlap_latent_frames` are both given (a long
    video: `num_frames` > `base_num_frames` with `overlap_history`). Then the first window has
    `base_latent_frames`, and each next one starts `overlap_latent_frames` back in the video, with as many of
    them as whole causal blocks of `block` frames hold as its prefix. `first_prefix`: the first window's
    given frames (image-to-video: the image's latent frame). ValueError when the overlap leaves no frame to
    generate.
    """
    if base_latent_frames is None or overlap_latent_frames is None:
        return (WindowShape(latent_frames, first_prefix),)
    stride = base_latent_frames - overlap_latent_frames
    if stride < 1:
        raise ValueError(
            f"the overlap ({overlap_latent_frames} latent frames) must be shorter than a window "
            f"({base_latent_frames} latent frames)"
        )
    count = 1 + (latent_frames - base_latent_frames - 1) // stride + 1
    prefix = overlap_latent_frames - overlap_latent_frames % block
    windows = [WindowShape(base_latent_frames, first_prefix)]
    for index in range(1, count):
        frames = min(latent_frames - index * stride, base_latent_frames)
        windows.append(WindowShape(frames, prefix, overlap_latent_frames))
    return tuple(windows)


def block_progress(blocks: int, steps: int, ar_step: int, ready_blocks: int) -> list[list[int]]:
    """Diffusers' progress rows (`generate_timestep_matrix`'s step indices), one list of `blocks` ints a row:
    the first `ready_blocks` start done; a block advances by one when it is the first or the one before it is
    at its last step or done, else it trails that one by `ar_step` (before clamping to [0, steps + 1])."""
    done = steps + 1
    previous = [done] * ready_blocks + [0] * (blocks - ready_blocks)
    rows = []
    while not all(p >= steps for p in previous):
        row: list[int] = []
        for i in range(blocks):
            if i == 0 or previous[i - 1] >= steps:
                row.append(previous[i] + 1)
            else:
                row.append(row[i - 1] - ar_step)
        clamped = [min(max(p, 0), done) for p in row]
        rows.append(clamped)
        previous = clamped
    return rows


@dataclass(frozen=True)
class FrameGroup:
    """Latent frames [start, stop) of a window that are stepped together (one scheduler state)."""

    start: int
    stop: int


@dataclass(frozen=True)
class WindowPlan:
    """One window's rows. `timesteps` is (rows, frames) float32 on the latents' device (the DiT's per-frame
    time input); `progress` and `updated` are the host's copies, per row and frame: the progress (a
    frame's scheduler step index is its progress - 1) and whether the frame is stepped at that row."""

    shape: WindowShape
    first_step: int
    timesteps: torch.Tensor
    progress: tuple[tuple[int, ...], ...]
    updated: tuple[tuple[bool, ...], ...]
    groups: tuple[FrameGroup, ...]

    @property
    def rows(self) -> int:
        return len(self.progress)


def _groups(columns: list[tuple[tuple[int, bool], ...]], block: int) -> tuple[FrameGroup, ...]:
    """Runs of adjacent blocks with equal columns, as frame ranges."""
    groups: list[FrameGroup] = []
    for i, column in enumerate(columns):
        if groups and columns[i - 1] == column:
            groups[-1] = FrameGroup(groups[-1].start, (i + 1) * block)
        else:
            groups.append(FrameGroup(i * block, (i + 1) * block))
    return tuple(groups)


def window_plan(
    shape: WindowShape,
    scheduler_timesteps: torch.Tensor,
    ar_step: int,
    block: int,
    first_step: int,
    device: torch.device,
) -> WindowPlan:
    """The rows of one window (`shape.frames` a multiple of `block`) over the scheduler's timesteps (their
    integer values, as Diffusers' int64 step template)."""
    steps = int(scheduler_timesteps.shape[0])
    blocks, ready = shape.frames // block, shape.prefix // block
    rows = block_progress(blocks, steps, ar_step, ready)
    previous = [steps + 1] * ready + [0] * (blocks - ready)
    moves = []
    for row in rows:
        moves.append([p != q and p != steps + 1 for p, q in zip(row, previous, strict=True)])
        previous = row
    columns = [
        tuple((row[i], moved[i]) for row, moved in zip(rows, moves, strict=True)) for i in range(blocks)
    ]
    progress = tuple(tuple(p for p in row for _ in range(block)) for row in rows)
    template = [NOT_STARTED_TIMESTEP, *(int(t) for t in scheduler_timesteps.tolist()), 0]
    timesteps = torch.tensor([[float(template[p]) for p in row] for row in progress], dtype=torch.float32)
    return WindowPlan(
        shape=shape,
        first_step=first_step,
        timesteps=timesteps.to(device),
        progress=progress,
        updated=tuple(tuple(m for m in moved for _ in range(block)) for moved in moves),
        groups=_groups(columns, block),
    )


@dataclass(frozen=True)
class ForcingPlan:
    """A request's windows in turn: engine step `s` is row `s - window.first_step` of the window holding it.
    `block`: the causal block's frames (the DiT's block-causal attention runs with it)."""

    windows: tuple[WindowPlan, ...]
    block: int

    @property
    def num_steps(self) -> int:
        last = self.windows[-1]
        return last.first_step + last.rows

    def locate(self, step: int) -> tuple[int, int]:
        """(window index, row) of engine step `step`."""
        for index, window in enumerate(self.windows):
            if step < window.first_step + window.rows:
                return index, step - window.first_step
        raise IndexError(f"step {step} is past the plan's {self.num_steps} steps")


def forcing_plan(
    shapes: tuple[WindowShape, ...],
    scheduler_timesteps: torch.Tensor,
    ar_step: int,
    block: int,
    device: torch.device,
) -> ForcingPlan:
    """Every window's rows, numbered on from the previous window's."""
    windows, first = [], 0
    for shape in shapes:
        window = window_plan(shape, scheduler_timesteps, ar_step, block, first, device)
        windows.append(window)
        first += window.rows
    return ForcingPlan(tuple(windows), block)


def row_step_indices(plan: ForcingPlan) -> list[int]:
    """Per engine step, the scheduler step index of its least advanced stepped frame: the row's place on the
    scheduler's sigmas, for what reads one sigma a step (the request's `Schedule`: previews, logs)."""
    indices = []
    for window in plan.windows:
        for progress, updated in zip(window.progress, window.updated, strict=True):
            stepped = [p for p, u in zip(progress, updated, strict=True) if u]
            if not stepped:
                raise AssertionError("a diffusion-forcing row steps no frame")
            indices.append(min(stepped) - 1)
    return indices
