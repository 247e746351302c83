"""Building one DiT batch from several requests, each with an optional negative (CFG) branch.

A request contributes `batch_size` rows for its prompt and, when `do_cfg`, `batch_size` more for
its negative prompt, right after. `split_guided` undoes this and applies each request's own CFG
scale, so requests with and without CFG, at different steps, share one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from diffserve.distributed.cfg_parallel import gather_branch_rows
from diffserve.layers.lora_rows import request_lora_scope
from diffserve.models.step_cache import BatchStepCache, CacheRows, batch_step_cache
from diffserve.request import LatentSize, Req
from diffserve.runtime.runner import CfgBranchView
from diffserve.stages.latent_preparation import pack_latents, unpack_latents
from diffserve.stages.mask_preparation import keep_unmasked


@dataclass
class BranchBatch:
    latents: list[torch.Tensor] = field(default_factory=list)
    text: list[torch.Tensor] = field(default_factory=list)
    pooled: list[torch.Tensor] = field(default_factory=list)
    timesteps: list[torch.Tensor] = field(default_factory=list)


def branch_texts(req: Req) -> list[torch.Tensor]:
    """The request's text states per branch, in row order: the prompt's, then the negative prompt's
    when it runs CFG."""
    return [req.prompt_embeds, req.negative_prompt_embeds] if req.do_cfg else [req.prompt_embeds]


def embedded_context(transformer, req: Req) -> torch.Tensor:
    """The request's text branches (`branch_texts`, in row order) through the DiT's context embedder
    (`transformer.embed_context`), under the request's LoRA scope, once per request: kept on
    `req.dit_context` and reused at every step, as the text does not change between steps."""
    if req.dit_context is None:
        with request_lora_scope(req.loras):
            req.dit_context = transformer.embed_context(torch.cat(branch_texts(req)))
    return req.dit_context


def with_branch_conditions(
    batch: BranchBatch, reqs: list[Req], condition: Callable[[Req], torch.Tensor], dim: int
) -> torch.Tensor:
    """The DiT's image tokens, one row per branch (`batch`, gathered from `reqs`): each branch's noisy
    tokens joined with its request's `condition(req)` along `dim` (1: tokens appended, an editor's
    input image; 2: channels widened, an inpainting condition)."""
    conditions = [condition(r) for r in reqs for _ in range(2 if r.do_cfg else 1)]
    return torch.cat([torch.cat([x, c], dim=dim) for x, c in zip(batch.latents, conditions, strict=True)])


def gather_branches(reqs: list[Req]) -> BranchBatch:
    """Per-row inputs for `reqs`, positive then negative branch per request, at each request's step
    (timesteps are rows of the request's device schedule: no host transfer)."""
    batch = BranchBatch()
    for req in reqs:
        branches = [(req.prompt_embeds, req.pooled_prompt_embeds)]
        if req.do_cfg:
            branches.append((req.negative_prompt_embeds, req.negative_pooled_prompt_embeds))
        t = req.schedule.timesteps[req.step_index]
        for text, pooled in branches:
            batch.latents.append(req.latents)
            batch.text.append(text)
            batch.pooled.append(pooled)
            batch.timesteps.append(t.expand(req.batch_size))
    return batch


def pad_text(texts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad (rows, len_i, dim) blocks to the longest; the (rows, len) mask is None when none is padded."""
    longest = max(t.shape[1] for t in texts)
    if all(t.shape[1] == longest for t in texts):
        return torch.cat(texts), None
    padded, masks = [], []
    for t in texts:
        rows, length, dim = t.shape
        padded.append(torch.cat([t, t.new_zeros(rows, longest - length, dim)], dim=1))
        # Built on the device (no host scalar copied in, which a step must not make).
        masks.append((torch.arange(longest, device=t.device) < length).expand(rows, longest))
    return torch.cat(padded), torch.cat(masks)


def classic_cfg(positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    return negative + scale * (positive - negative)


CfgCombine = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def split_guided(
    prediction: torch.Tensor, reqs: list[Req], combine: CfgCombine = classic_cfg
) -> list[torch.Tensor]:
    """Each request's prediction, with CFG applied by `combine(positive, negative, scale)`
    (default `negative + scale * (positive - negative)`). Under CFG-parallel a request may be one
    branch's `CfgBranchView`: its rows are this rank's branch, joined with the other cfg rank's here. A
    view whose negative branch is approximated (FasterCache's skipped steps) gets it from its cache."""
    out, offset, views = [], 0, []
    for req in reqs:
        n = req.batch_size
        positive = prediction[offset : offset + n]
        offset += n
        if req.do_cfg:
            negative = prediction[offset : offset + n]
            offset += n
            keep_branch_difference(req, positive, negative)
            positive = combine(positive, negative, req.cfg_scale)
        elif isinstance(req, CfgBranchView) and req.negative_approximated:
            positive = combine(positive, approximated_negative(req, positive), req.cfg_scale)
        elif isinstance(req, CfgBranchView):
            views.append((len(out), positive))
        out.append(positive)
    if views:
        _combine_branch_views(out, views, reqs, combine)
    return out


Regrid = Callable[[torch.Tensor], torch.Tensor]


def token_grid(tokens: torch.Tensor, size: LatentSize | None) -> tuple[torch.Tensor, Regrid] | None:
    """(batch, tokens, channels) latent tokens on their grid of `size`, and the map back: 2x2-packed tokens
    (FLUX.1, FLUX.2, Qwen-Image) unpacked to (batch, channels, height, width), frame-major 1x1x1 tokens
    (LTX-2) unflattened to (batch, channels, frames, height, width); None for other tokens."""
    if tokens.ndim != 3 or size is None:
        return None
    height, width = size.height, size.width
    count, channels = tokens.shape[1:]
    if count == (height // 2) * (width // 2) and channels % 4 == 0:
        return unpack_latents(tokens, height, width), pack_latents
    if height * width and count % (height * width) == 0:
        grid = tokens.transpose(1, 2).unflatten(2, (count // (height * width), height, width))
        return grid, lambda g: g.flatten(2).transpose(1, 2)
    return None


def spatial_rows(rows: torch.Tensor, req: Req) -> tuple[torch.Tensor, Regrid]:
    """`rows` of a request's prediction (its latents' layout) on their spatial grid, (..., height, width),
    and the map back: a latent image or video as it is (its last two dimensions are the grid's), tokens
    as `token_grid` puts them."""
    if rows.ndim in (4, 5):
        return rows, lambda grid: grid
    gridded = token_grid(rows, req.latent_size)
    if gridded is None:
        raise RuntimeError(
            f"no spatial grid for a prediction of shape {tuple(rows.shape)} ({req.latent_size})"
        )
    return gridded


def keep_branch_difference(req: Req, positive: torch.Tensor, negative: torch.Tensor) -> None:
    """A request that approximates its negative branch on some steps (`RequestCache.unconditional`) keeps
    the two branches' difference from a step that ran both."""
    branch = None if req.step_cache is None else req.step_cache.unconditional
    if branch is not None:
        branch.keep_difference(spatial_rows(positive, req)[0], spatial_rows(negative, req)[0])


def approximated_negative(req: Req, positive: torch.Tensor) -> torch.Tensor:
    """The negative branch's prediction standing in for it at a step that ran `positive` alone."""
    branch = None if req.step_cache is None else req.step_cache.unconditional
    timestep = req.host_timestep
    if branch is None or timestep is None:
        raise RuntimeError("a request whose negative branch is approximated needs its cache and timestep")
    grid, back = spatial_rows(positive, req)
    return back(branch.approximate(grid, timestep))


def _combine_branch_views(
    out: list[torch.Tensor],
    views: list[tuple[int, torch.Tensor]],
    reqs: list[Req],
    combine: CfgCombine,
) -> None:
    """One all-gather of every view's rows over the cfg group, then each view's guided prediction in
    `out` (identical on both cfg ranks)."""
    positives, negatives = gather_branch_rows(torch.cat([rows for _, rows in views]))
    start = 0
    for index, rows in views:
        n = rows.shape[0]
        out[index] = combine(
            positives[start : start + n], negatives[start : start + n], reqs[index].cfg_scale
        )
        start += n


def advance_requests(scheduler, reqs: list[Req], predictions: list[torch.Tensor]) -> None:
    """Advance every request one step along its own sigmas, with its own scheduler state (multistep
    schedulers keep a per-request history there; Euler keeps none). An inpainting request then gets its
    unmasked area back from its input image (`keep_unmasked`), as Diffusers does after every step."""
    for req, noise_pred in zip(reqs, predictions, strict=True):
        if req.step_index == 0 and req.scheduler_state is None:
            req.scheduler_state = scheduler.new_state()
        req.last_prediction = noise_pred  # kept for previews (stages/previews.py); no copy, no compute
        schedule = req.schedule
        assert schedule is not None
        latents = scheduler.step_request(
            noise_pred,
            req.latents,
            schedule.sigmas,
            req.step_index,
            req.scheduler_state,
            schedule.host_sigmas,
        )
        inpainting = req.input_latents is not None and req.input_latents.mask is not None
        req.latents = keep_unmasked(req, latents) if inpainting else latents
        req.step_index += 1


def next_timesteps(req: Req) -> torch.Tensor:
    """MeanFlow's second time for `req`'s step: the next step's timestep, 0 after the last (as Diffusers'
    MeanFlow pipelines pass it)."""
    if req.step_index + 1 < req.num_steps:
        return req.schedule.timesteps[req.step_index + 1]
    return torch.zeros((), device=req.schedule.timesteps.device, dtype=req.schedule.timesteps.dtype)


def latent_grid(latents: torch.Tensor, size: LatentSize | None) -> torch.Tensor:
    """A request's latents on their grid, (outputs, channels, frames, height, width), whatever the family's
    layout: a latent video as it is, a latent image as one frame, 2x2-packed tokens (FLUX.1, FLUX.2,
    Qwen-Image) unpacked, frame-major 1x1x1 tokens (LTX-2) unflattened, other tokens as one row."""
    if latents.ndim == 5:
        return latents
    if latents.ndim == 4:
        return latents.unsqueeze(2)
    gridded = token_grid(latents, size)
    if gridded is not None:
        grid = gridded[0]
        return grid if grid.ndim == 5 else grid.unsqueeze(2)
    if latents.ndim == 3:
        return latents.transpose(1, 2)[:, :, None, None, :]
    return latents.reshape(latents.shape[0], 1, 1, 1, -1)


def latent_probe(req: Req) -> tuple[torch.Tensor, float]:
    """The request's latent probe (`cache_methods.batch.LatentProbe`): its latents on their grid and this
    step's sigma (from the schedule's CPU copy: no host sync)."""
    assert req.latents is not None and req.schedule is not None
    sigma = float(req.schedule.host_sigmas[req.step_index])
    return latent_grid(req.latents, req.latent_size), sigma


def request_cache_rows(req: Req, rows_per_branch: int, branches: int) -> list[CacheRows]:
    """A request's `CacheRows` for `branches` consecutive branches of `rows_per_branch` rows each (the
    positive prompt's first): one group, or, when its cache keeps the CFG branch apart, the positive
    rows with its cache and the rest with the CFG branch's."""
    state = req.step_cache
    latent = partial(latent_probe, req)

    def timestep() -> float | None:
        return req.host_timestep

    if state is not None and state.cfg_branch is not None and branches > 1:
        rest = rows_per_branch * (branches - 1)
        return [
            CacheRows(state, rows_per_branch, req.step_index, req.num_steps, latent, timestep),
            CacheRows(state.cfg_branch, rest, req.step_index, req.num_steps, latent, timestep),
        ]
    return [CacheRows(state, rows_per_branch * branches, req.step_index, req.num_steps, latent, timestep)]


def step_cache_for(reqs: list[Req]) -> BatchStepCache | None:
    """The DiT's step cache for a batch built by `gather_branches` (each request's positive rows then
    its negative rows), or None when no request in it has a cache."""
    return batch_step_cache(
        [rows for req in reqs for rows in request_cache_rows(req, req.batch_size, 2 if req.do_cfg else 1)]
    )
