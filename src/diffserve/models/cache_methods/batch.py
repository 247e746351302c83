"""`BatchStepCache`: one DiT forward's blocks over a batch whose requests cache differently.

The batch's rows are grouped by request (`CacheRows`: its consecutive rows, its `RequestCache` or None
for an exact request, its step). Each request plans, probes and decides on its own (`base.py`); rows that
compute run their blocks together, rows that reuse add their own cached residual, so requests with
different methods and settings share one forward and each row gets what it would get alone (up to the
rounding of a matmul over another number of rows).

Two ways to run, chosen per forward:

- Whole span: every request reuses all blocks or none (TeaCache, MagCache, TaylorSeer, SCM, the quality
  tiers). The DiT's `run_blocks(rows)` runs every block for `rows` (None: all) and returns the output
  head's input; without any reuse it runs once over the batch, the DiT's own path.
- Block ranges: some request computes the first and last blocks of every step (DBCache). The DiT hands a
  `BlockRange` (`blocks.py`); the blocks run range by range between the batch's cut points, each range on
  the rows that compute it, and each request decides when its first blocks are done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from diffserve.layers.attention_reuse import attention_reuse_scope
from diffserve.layers.lora_rows import narrowed_lora_rows
from diffserve.models.cache_methods.attention_level import AttentionCacheState, AttentionReuseScope, ReuseRows
from diffserve.models.cache_methods.base import Plan, RequestCache
from diffserve.models.cache_methods.blocks import BlockRange, Streams

RunBlocks = Callable[[torch.Tensor | None], torch.Tensor]
Signal = torch.Tensor | Callable[[], torch.Tensor]
#: A request's input latents on their grid, (outputs, channels, frames, height, width), and its step's sigma.
LatentProbe = Callable[[], tuple[torch.Tensor, float]]


@dataclass(frozen=True)
class CacheRows:
    """A request's consecutive rows in the DiT batch, with its cache (None: always run the blocks); or,
    for a request whose cache keeps the CFG branch apart (`enable_separate_cfg`), one branch's rows with
    that branch's cache. `latent`: the request's latent probe (`LatentProbe`), called only when its cache
    probes the latents (SeaCache); `timestep`: gives the step's timestep (None where not known), called
    only when its cache compares timesteps with its ranges (the attention-level methods, PAB and
    FasterCache)."""

    state: RequestCache | None
    rows: int
    step_index: int
    num_steps: int
    latent: LatentProbe | None = None
    timestep: Callable[[], float | None] | None = None


@dataclass
class _Group:
    """One request's part of this forward: its rows and what it decided."""

    cache: CacheRows
    lo: int
    hi: int
    plan: Plan = Plan.COMPUTE
    reused: bool = False
    decided: bool = False
    #: Block ranges only: the span `[first, last)` it may skip, its rows, the span's input, and the image
    #: stream at its probe's base (the input of the blocks whose output residual it probes).
    first: int = 0
    last: int = 0
    rows: torch.Tensor | None = None
    span_input: Streams | None = None
    probe_input: torch.Tensor | None = None

    @property
    def state(self) -> RequestCache | None:
        return self.cache.state

    @property
    def step(self) -> int:
        return self.cache.step_index


class BatchStepCache:
    """The cache of one DiT forward: which rows belong to which request, and their states."""

    def __init__(self, groups: Sequence[CacheRows]) -> None:
        self.groups = list(groups)
        #: This forward's attention reuse, when a request runs an attention-level method.
        self._reuse: AttentionReuseScope | None = None

    @property
    def total_rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def run(
        self,
        x: torch.Tensor,
        signal: Signal,
        run_blocks: RunBlocks,
        blocks: Callable[[], BlockRange] | None = None,
    ) -> torch.Tensor:
        """The blocks' output for every row of `x` (the first block's image input). `signal`: the probe
        of signal-probing methods, or a function computing it, called only when one needs it; `blocks`:
        a function giving the DiT's `BlockRange`, called only when a request needs ranges."""
        if x.shape[0] != self.total_rows:
            raise ValueError(f"step cache covers {self.total_rows} rows, the batch has {x.shape[0]}")
        groups, start = [], 0
        for cache in self.groups:
            groups.append(_Group(cache, start, start + cache.rows))
            start += cache.rows
        self._reuse = self._attention_reuse(groups)
        with attention_reuse_scope(self._reuse):
            return self._run(x, groups, signal, run_blocks, blocks)

    def _run(
        self,
        x: torch.Tensor,
        groups: list[_Group],
        signal: Signal,
        run_blocks: RunBlocks,
        blocks: Callable[[], BlockRange] | None,
    ) -> torch.Tensor:
        for g in groups:
            if g.state is not None:
                g.plan = g.state.plan(g.step, g.cache.num_steps)
        self._early_decisions(groups, signal, x)
        whole = all(g.state is None or g.state.span() == (0, g.state.num_blocks) for g in groups)
        if whole:
            return self._run_whole(x, groups, run_blocks)
        if blocks is None:
            method = next(g.state.method for g in groups if g.state is not None and g.state.span()[0] > 0)
            raise RuntimeError(
                f"cache method {method!r} needs the DiT's blocks in ranges; this DiT runs them whole"
            )
        return self._run_ranges(groups, blocks())

    @staticmethod
    def _attention_reuse(groups: list[_Group]) -> AttentionReuseScope | None:
        """The scope through which attention modules run when some request reuses attention outputs
        (each such request decides this forward's reuse at its timestep first); None otherwise."""
        attention = [g for g in groups if isinstance(g.state, AttentionCacheState)]
        if not attention:
            return None
        for g in attention:
            timestep = None if g.cache.timestep is None else g.cache.timestep()
            if timestep is None:
                raise RuntimeError(f"cache method {g.state.method!r} needs the step's timestep")
            g.state.begin_forward(timestep)
        return AttentionReuseScope(
            [
                ReuseRows(g.state if isinstance(g.state, AttentionCacheState) else None, g.lo, g.hi)
                for g in groups
            ]
        )

    def _running(self, bounds: list[tuple[int, int]] | None) -> AbstractContextManager[None]:
        """Tell this forward's attention reuse which requests' rows the blocks now run on."""
        return nullcontext() if self._reuse is None else self._reuse.running(bounds)

    # -- decisions ------------------------------------------------------------------------------------------

    def _early_decisions(self, groups: list[_Group], signal: Signal, x: torch.Tensor) -> None:
        """Decide every request probing the signal, the blocks' input or its latents now, before any block
        runs (one host transfer); the signal is computed only when a request probes it."""
        probing = [
            g for g in groups if g.state is not None and g.state.probe in ("signal", "input", "latent")
        ]
        if not probing:
            for g in groups:
                self._settle(g)
            return
        values = None
        if any(g.state is not None and g.state.probe == "signal" for g in probing):
            values = signal() if callable(signal) else signal
            if values.shape[0] != self.total_rows:
                raise ValueError(
                    f"step cache covers {self.total_rows} rows, the signal has {values.shape[0]}"
                )
        probes = []
        for g in probing:
            assert g.state is not None
            if g.state.probe == "latent":
                if g.cache.latent is None:
                    raise RuntimeError(f"cache method {g.state.method!r} needs the request's latents")
                probes.append(g.state.indicator(*g.cache.latent()))
                continue
            source = x if g.state.probe == "input" else values
            assert source is not None
            probes.append(source[g.lo : g.hi])
        self._decide(probing, probes)
        for g in groups:
            self._settle(g)

    def _decide(self, groups: list[_Group], probes: list[torch.Tensor]) -> None:
        """MEASURE plans decided from their probes' changes, fetched in one transfer; every probe kept."""
        pending = [
            g.state.measure(p) if g.plan is Plan.MEASURE else None
            for g, p in zip(groups, probes, strict=True)
        ]
        present = [c for c in pending if c is not None]
        values = iter(torch.stack(present).float().tolist()) if present else iter(())
        for g, probe, change in zip(groups, probes, pending, strict=True):
            assert g.state is not None
            if g.plan is Plan.MEASURE:
                g.reused = g.state.decide(None if change is None else next(values), g.step, g.cache.num_steps)
            else:
                g.reused = g.plan is Plan.REUSE
            g.decided = True
            g.state.keep_probe(probe, g.reused)

    @staticmethod
    def _settle(g: _Group) -> None:
        """A request without a probe (or exact) decided by its plan."""
        if g.decided or (g.state is not None and g.state.probe != "none"):
            return
        g.reused = g.state is not None and g.plan is Plan.REUSE and g.state.has_residual
        g.decided = True

    # -- whole span ---------------------------------------------------------------------------------------

    def _run_whole(self, x: torch.Tensor, groups: list[_Group], run_blocks: RunBlocks) -> torch.Tensor:
        if not any(g.reused for g in groups):
            with self._running(None):
                out = run_blocks(None)
            self._finish_whole(out, x, groups)
            return out
        compute_bounds = [(g.lo, g.hi) for g in groups if not g.reused]
        computed = None
        if compute_bounds:
            rows = torch.cat([torch.arange(lo, hi, device=x.device) for lo, hi in compute_bounds])
            # the LoRA rows of the batch the blocks now run
            with narrowed_lora_rows(compute_bounds), self._running(compute_bounds):
                computed = run_blocks(rows)
        pieces, offset = [], 0
        for g in groups:
            if g.reused:
                assert g.state is not None
                pieces.append(x[g.lo : g.hi] + g.state.reused_residual(g.step).image)
            else:
                assert computed is not None
                pieces.append(computed[offset : offset + g.hi - g.lo])
                offset += g.hi - g.lo
        out = torch.cat(pieces)
        self._finish_whole(out, x, groups)
        return out

    @staticmethod
    def _finish_whole(out: torch.Tensor, x: torch.Tensor, groups: list[_Group]) -> None:
        """Keep the fresh residual of every cached request that ran the blocks, and count the step."""
        for g in groups:
            if g.state is None:
                continue
            if not g.reused:
                g.state.store(Streams(out[g.lo : g.hi] - x[g.lo : g.hi]), g.step)
            g.state.record(g.reused)

    # -- block ranges -------------------------------------------------------------------------------------

    def _run_ranges(self, groups: list[_Group], blocks: BlockRange) -> torch.Tensor:
        n = blocks.num_blocks
        cur = blocks.start()
        bases: dict[int, int] = {}  # group index -> the block its probe's residual starts at
        for i, g in enumerate(groups):
            if g.state is not None and g.state.num_blocks != n:
                raise ValueError(f"the request's cache counts {g.state.num_blocks} blocks, the DiT has {n}")
            g.first, g.last = (n, n) if g.state is None else g.state.span()
            g.rows = torch.arange(g.lo, g.hi, device=cur.image.device)
            if g.state is not None and g.state.probe == "residual":
                bases[i] = g.state.probe_base
        points = sorted({0, n, *(g.first for g in groups), *(g.last for g in groups), *bases.values()})
        for a, b in zip(points, [*points[1:], None], strict=True):
            for i, base in bases.items():
                if base == a:
                    groups[i].probe_input = cur.image.index_select(0, groups[i].rows)
            at_first = [g for g in groups if g.first == a]
            self._probe_decisions(at_first, cur)
            for g in at_first:
                if g.reused:  # jump over the span: its input plus the cached residual
                    assert g.state is not None
                    part = cur.take(g.rows).plus(g.state.reused_residual(g.step), need_text=g.last < n)
                    cur = cur.put(g.rows, part)
                else:
                    g.span_input = cur.take(g.rows)
            for g in groups:
                if g.last == a and g.state is not None and not g.reused:
                    assert g.span_input is not None
                    g.state.store(cur.take(g.rows).minus(g.span_input), g.step)
            if b is None:
                break
            active = [g for g in groups if b <= g.first or a >= g.last or not g.reused]
            cur = self._run_segment(blocks, cur, active, len(groups), a, b)
        for g in groups:
            if g.state is not None:
                g.state.record(g.reused)
        return cur.image

    def _probe_decisions(self, at_first: list[_Group], cur: Streams) -> None:
        """Decide the residual-probing requests whose first blocks end here: their probe is those blocks'
        output residual on the image tokens (output minus the image stream at the probe's base)."""
        probing = [g for g in at_first if g.state is not None and g.state.probe == "residual"]
        if probing:
            probes = []
            for g in probing:
                assert g.probe_input is not None, "the probe's base is a cut point before the span"
                probes.append(cur.image.index_select(0, g.rows) - g.probe_input)
            self._decide(probing, probes)

    def _run_segment(
        self, blocks: BlockRange, cur: Streams, active: list[_Group], total: int, a: int, b: int
    ) -> Streams:
        """Blocks `[a, b)` on the `active` requests' rows (all `total` of them: one call over the batch)."""
        if not active:
            return cur
        if len(active) == total:
            with self._running(None):
                return blocks.run(cur, None, a, b)
        rows = torch.cat([g.rows for g in active])
        bounds = [(g.lo, g.hi) for g in active]
        with narrowed_lora_rows(bounds), self._running(bounds):
            part = blocks.run(cur.take(rows), rows, a, b)
        return cur.put(rows, part)


def batch_step_cache(groups: Sequence[CacheRows]) -> BatchStepCache | None:
    """A `BatchStepCache` when any group has a cache, else None (the model's exact path)."""
    return BatchStepCache(groups) if any(g.state is not None for g in groups) else None
