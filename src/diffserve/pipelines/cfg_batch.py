"""Building one DiT batch from several requests, each with an optional negative (CFG) branch.

A request contributes `batch_size` rows for its prompt and, when `do_cfg`, `batch_size` more for
its negative prompt, right after. `split_guided` undoes this and applies each request's own CFG
scale, so requests with and without CFG, at different steps, share one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diffserve.distributed.cfg_parallel import gather_branch_rows
from diffserve.models.step_cache import BatchStepCache, CacheRows, batch_step_cache
from diffserve.request import Req
from diffserve.runtime.runner import CfgBranchView
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
        mask = torch.zeros(rows, longest, dtype=torch.bool, device=t.device)
        mask[:, :length] = True
        masks.append(mask)
    return torch.cat(padded), torch.cat(masks)


def classic_cfg(positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    return negative + scale * (positive - negative)


CfgCombine = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def split_guided(
    prediction: torch.Tensor, reqs: list[Req], combine: CfgCombine = classic_cfg
) -> list[torch.Tensor]:
    """Each request's prediction, with CFG applied by `combine(positive, negative, scale)`
    (default `negative + scale * (positive - negative)`). Under CFG-parallel a request may be one
    branch's `CfgBranchView`: its rows are this rank's branch, joined with the other cfg rank's here."""
    out, offset, views = [], 0, []
    for req in reqs:
        n = req.batch_size
        positive = prediction[offset : offset + n]
        offset += n
        if req.do_cfg:
            negative = prediction[offset : offset + n]
            offset += n
            positive = combine(positive, negative, req.cfg_scale)
        elif isinstance(req, CfgBranchView):
            views.append((len(out), positive))
        out.append(positive)
    if views:
        _combine_branch_views(out, views, reqs, combine)
    return out


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


def step_cache_for(reqs: list[Req]) -> BatchStepCache | None:
    """The DiT's step cache for a batch built by `gather_branches` (each request's positive rows then
    its negative rows), or None when no request in it uses an approximate quality tier."""
    return batch_step_cache(
        [
            CacheRows(
                req.step_cache, req.batch_size * (2 if req.do_cfg else 1), req.step_index, req.num_steps
            )
            for req in reqs
        ]
    )
