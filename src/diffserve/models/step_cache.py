"""What a DiT's forward calls to let its requests reuse work between denoising steps.

Per request, never per server: each request carries its own cache state (`Req.step_cache`, a
`models/cache_methods/base.RequestCache`: a quality tier's `StepCacheState`, or a cache method the request
named: DBCache, TeaCache, ...), so in one DiT batch some rows run the blocks and others reuse their cached
residual. A batch with no cached request takes the model's exact path (`BatchStepCache` is not built at
all), so a request without a cache is bit-for-bit the eager path.

How a DiT uses it, in its forward (see `models/dits/flux.py`):

    x = embed(inputs)                                  # the first block's input, (rows, tokens, dim)
    x = run_with_step_cache(
        step_cache, x,
        lambda: first_block_modulated_input(x, temb),  # the signal TeaCache-like methods watch
        lambda rows: blocks_for_rows(rows),            # every block, for `rows` (None: all)
        blocks=FluxBlockRange(...),                    # optional: the blocks in ranges (DBCache)
    )
    return head(x)

`blocks_for_rows(rows)` runs every block on the rows in `rows` (a LongTensor of batch rows, or None
for all of them), slicing every per-row input (text, timestep embedding, masks) by it with `take_rows`,
and returns the hidden state the output head reads, for those rows, shaped like `x[rows]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.models.cache_methods.batch import BatchStepCache, CacheRows, RunBlocks, batch_step_cache
from diffserve.models.cache_methods.blocks import BlockRange
from diffserve.models.cache_methods.tier import StepCacheState

__all__ = [
    "BatchStepCache",
    "CacheRows",
    "StepCachePolicy",
    "StepCacheState",
    "batch_step_cache",
    "run_with_step_cache",
    "take_rows",
]


def run_with_step_cache(
    step_cache: BatchStepCache | None,
    x: torch.Tensor,
    signal: Callable[[], torch.Tensor],
    run_blocks: RunBlocks,
    blocks: Callable[[], BlockRange] | None = None,
) -> torch.Tensor:
    """A DiT forward's blocks over the batch `x`: `run_blocks(None)` (every block for every row, exact)
    without a step cache, else `step_cache.run(...)` (the signal computed only when a request watches it).
    `blocks()`: the DiT's `BlockRange` for this forward, built only when a request needs ranges; None for
    a DiT that runs its blocks whole (it then serves the whole-span methods only)."""
    if step_cache is None:
        return run_blocks(None)
    return step_cache.run(x, signal, run_blocks, blocks)


def take_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`t` restricted to batch rows `rows` (None: all), for `run_blocks`; a 1-row tensor broadcast over
    the batch (a shared timestep embedding, say) stays as it is."""
    return t if rows is None or t.shape[0] == 1 else t.index_select(0, rows)
