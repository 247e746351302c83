"""CFG-parallel: with cfg degree 2, cfg-rank 0 runs the positive rows of a CFG request and cfg-rank 1 its
negative rows; the two halves are all-gathered before the guidance is combined.

How, without a line in any family's denoiser: for a denoising step each rank's `ModelRunner` hands the
pipeline a `CfgBranchView` (runtime/runner.py) of every CFG request instead of the request itself: a `Req` with `do_cfg=False` whose
text states are this rank's branch (the prompt's on cfg-rank 0, the negative prompt's on cfg-rank 1).
The denoiser builds its one DiT batch from those rows as for any request without CFG (its per-request
caches, such as `dit_context`, live on the view and hold that branch only). `split_guided`
(pipelines/cfg_batch.py) sees the views, all-gathers their rows over the cfg group (equal sizes on
both ranks: every CFG request has as many negative rows as positive ones) and applies each request's CFG
scale, so both ranks take the same step; the request's step state is copied back after the step.

Which requests are split: those with CFG and the exact quality tier. A request without CFG has one branch:
both cfg ranks compute it redundantly (no communication; the batch still shares one forward). A request
of an approximate quality tier is also computed whole on both ranks, because its step cache decides
whether to reuse a step from the rows it sees, and both halves must take the same decision.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from diffserve.distributed.state import current_parallel_state


def gather_branch_rows(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's branch rows of every split request, all-gathered over the cfg group: (positive rows,
    negative rows), in the same order on both ranks."""
    state = current_parallel_state()
    if state is None or state.cfg_degree != 2:
        raise RuntimeError("CFG branch views exist only inside a parallel scope with cfg degree 2")
    local = local.contiguous()
    halves = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(halves, local, group=state.cfg_group)
    return halves[0], halves[1]
