"""The step-cache run of a two-stream DiT whose blocks read one bundle of per-row inputs.

Such a DiT keeps what every block reads besides its two token streams (timestep modulation, RoPE tables,
masks, ControlNet residuals) in one `BlockInputs`-style tuple whose `take(rows)` gives the share of some
batch rows (per-row tensors indexed, shared ones kept). Its forward then runs the blocks the same way
whatever the model: `run_streams_with_step_cache`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, Self, TypeVar

import torch

from diffserve.models.cache_methods.blocks import BlockRange
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows


class RowInputs(Protocol):
    """Per-forward block inputs that can be cut to some batch rows."""

    def take(self, rows: torch.Tensor | None) -> Self:
        """These inputs for batch rows `rows` (None: all)."""
        ...


Inputs = TypeVar("Inputs", bound=RowInputs)


def run_streams_with_step_cache(
    step_cache: BatchStepCache | None,
    x: torch.Tensor,
    ctx: torch.Tensor,
    inputs: Inputs,
    signal: Callable[[], torch.Tensor],
    run_blocks: Callable[[torch.Tensor, torch.Tensor, Inputs], torch.Tensor],
    block_range: Callable[[torch.Tensor, torch.Tensor, Inputs], BlockRange] | None = None,
) -> torch.Tensor:
    """`run_with_step_cache` over the stream `x` (the one the output head reads), the second stream `ctx`
    and the blocks' `inputs`: `run_blocks(x, ctx, inputs)` of the rows the cache runs (every row without a
    step cache), `block_range(x, ctx, inputs)` of the whole batch for the block-range methods (None: a DiT
    that serves the whole-span methods only). `signal`: what the step cache watches change."""
    blocks = None if block_range is None else (lambda: block_range(x, ctx, inputs))
    return run_with_step_cache(
        step_cache,
        x,
        signal,
        lambda rows: run_blocks(take_rows(x, rows), take_rows(ctx, rows), inputs.take(rows)),
        blocks,
    )
