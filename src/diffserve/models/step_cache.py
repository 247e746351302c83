"""Step caching for the approximate `quality` tiers: reuse the DiT blocks' work between denoising steps.

Between two consecutive denoising steps a DiT's blocks change the hidden state by nearly the same
residual (output of the last block minus input of the first). When a cheap signal, the first block's
timestep-modulated input (the TeaCache idea), has moved little since the last step that ran every
block, the blocks are skipped and that step's residual is added to the new input instead.

Per request, never per server: each request carries its own `StepCacheState` (policy, accumulated
change, cached residual, counters), so in one DiT batch some rows run the blocks and others reuse
their residual. The rows of one request (its outputs and its CFG branches) always decide together.
A batch with no cached request takes the model's exact path (`BatchStepCache` is not built at all),
so the exact tier (`high`) is bit-for-bit the eager path.

How a DiT uses it, in its forward (see `models/dits/flux.py`):

    x = embed(inputs)                                  # the first block's input, (rows, tokens, dim)
    if step_cache is None:
        out = blocks(x)
    else:
        signal = first_block_modulated_input(x, temb)  # cheap: one LayerNorm and a modulation
        out = step_cache.run(x, signal, lambda rows: blocks_for_rows(rows))
    return head(out)

`blocks_for_rows(rows)` runs every block on the rows in `rows` (a LongTensor of batch rows, or None
for all of them), slicing every per-row input (text, timestep embedding, masks) by it, and returns
the hidden state the output head reads, for those rows, shaped like `x[rows]`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.layers.lora_rows import narrowed_lora_rows

RunBlocks = Callable[[torch.Tensor | None], torch.Tensor]


@dataclass
class StepCacheState:
    """One request's cache: what it last saw and what it can reuse, plus the counts it reports."""

    policy: StepCachePolicy
    accumulated_change: float = 0.0
    last_signal: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    reused_in_a_row: int = 0
    #: Per step: True when the blocks ran, False when the residual was reused.
    history: list[bool] = field(default_factory=list)

    @property
    def steps_computed(self) -> int:
        return sum(self.history)

    @property
    def steps_reused(self) -> int:
        return len(self.history) - self.steps_computed

    def relative_change(self, signal: torch.Tensor) -> torch.Tensor | None:
        """Mean |signal - last| / mean |last| as a 0-d tensor (no host sync), None on the first step."""
        if self.last_signal is None or self.last_signal.shape != signal.shape:
            return None
        return (signal - self.last_signal).abs().mean() / self.last_signal.abs().mean().clamp_min(1e-12)

    def decide(self, change: float | None, step_index: int, num_steps: int) -> bool:
        """True to reuse the residual this step. Updates the accumulated change either way."""
        policy = self.policy
        if change is not None:
            self.accumulated_change += change
        forced_full = (
            self.residual is None
            or change is None
            or step_index < policy.full_first_steps
            or step_index >= num_steps - policy.full_last_steps
            or self.reused_in_a_row >= policy.max_reuse_in_a_row
        )
        return not forced_full and self.accumulated_change < policy.threshold

    def record(self, reused: bool) -> None:
        self.history.append(not reused)
        if reused:
            self.reused_in_a_row += 1
        else:
            self.reused_in_a_row = 0
            self.accumulated_change = 0.0


@dataclass(frozen=True)
class CacheRows:
    """A request's consecutive rows in the DiT batch, with its cache (None: always run the blocks)."""

    state: StepCacheState | None
    rows: int
    step_index: int
    num_steps: int


class BatchStepCache:
    """The step cache of one DiT forward: which rows belong to which request, and their states."""

    def __init__(self, groups: Sequence[CacheRows]) -> None:
        self.groups = list(groups)

    @property
    def total_rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def run(self, x: torch.Tensor, signal: torch.Tensor, run_blocks: RunBlocks) -> torch.Tensor:
        """The blocks' output for every row of `x`: run for rows that must, reused for the others.

        `x` is the first block's input and `signal` the per-row value whose change decides reuse
        (both with `total_rows` rows). Returns what `run_blocks(None)` would, approximately.
        """
        if x.shape[0] != self.total_rows or signal.shape[0] != self.total_rows:
            raise ValueError(f"step cache covers {self.total_rows} rows, the batch has {x.shape[0]}")
        bounds, start = [], 0
        for group in self.groups:
            bounds.append((start, start + group.rows))
            start += group.rows
        changes: list[float | None] = self._changes(signal, bounds)
        reuse = [
            group.state is not None and group.state.decide(change, group.step_index, group.num_steps)
            for group, change in zip(self.groups, changes, strict=True)
        ]
        for group, (lo, hi) in zip(self.groups, bounds, strict=True):
            if group.state is not None:
                group.state.last_signal = signal[lo:hi].detach().clone()

        if not any(reuse):
            out = run_blocks(None)
            self._store(out, x, bounds, reuse)
            return out

        compute_bounds = [b for b, r in zip(bounds, reuse, strict=True) if not r]
        computed = None
        if compute_bounds:
            rows = torch.cat([torch.arange(lo, hi, device=x.device) for lo, hi in compute_bounds])
            with narrowed_lora_rows(compute_bounds):  # the LoRA rows of the batch the blocks now run
                computed = run_blocks(rows)
        pieces, offset = [], 0
        for group, (lo, hi), reused in zip(self.groups, bounds, reuse, strict=True):
            if reused:
                assert group.state is not None and group.state.residual is not None
                pieces.append(x[lo:hi] + group.state.residual)
            else:
                assert computed is not None
                pieces.append(computed[offset : offset + hi - lo])
                offset += hi - lo
        out = torch.cat(pieces)
        self._store(out, x, bounds, reuse)
        return out

    def _changes(self, signal: torch.Tensor, bounds: list[tuple[int, int]]) -> list[float | None]:
        """Each cached group's relative signal change, fetched from the device in one transfer."""
        pending = []
        for group, (lo, hi) in zip(self.groups, bounds, strict=True):
            pending.append(None if group.state is None else group.state.relative_change(signal[lo:hi]))
        present = [c for c in pending if c is not None]
        values = iter(torch.stack(present).float().tolist()) if present else iter(())
        return [None if c is None else next(values) for c in pending]

    def _store(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        bounds: list[tuple[int, int]],
        reuse: list[bool],
    ) -> None:
        """Keep the fresh residual of every cached group that ran the blocks, and count the step."""
        for group, (lo, hi), reused in zip(self.groups, bounds, reuse, strict=True):
            state = group.state
            if state is None:
                continue
            if not reused:
                state.residual = (out[lo:hi] - x[lo:hi]).detach()
            state.record(reused)


def run_with_step_cache(
    step_cache: BatchStepCache | None,
    x: torch.Tensor,
    signal: Callable[[], torch.Tensor],
    run_blocks: RunBlocks,
) -> torch.Tensor:
    """A DiT forward's blocks over the batch `x`: `run_blocks(None)` (every block for every row, exact)
    without a step cache, else `step_cache.run(x, signal(), run_blocks)` (the signal computed only then).
    `run_blocks(rows)` takes its per-row inputs with `take_rows`."""
    if step_cache is None:
        return run_blocks(None)
    return step_cache.run(x, signal(), run_blocks)


def take_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`t` restricted to batch rows `rows` (None: all), for `run_blocks`; a 1-row tensor broadcast over
    the batch (a shared timestep embedding, say) stays as it is."""
    return t if rows is None or t.shape[0] == 1 else t.index_select(0, rows)


def batch_step_cache(groups: Sequence[CacheRows]) -> BatchStepCache | None:
    """A `BatchStepCache` when any group has a cache, else None (the model's exact path)."""
    return BatchStepCache(groups) if any(g.state is not None for g in groups) else None
