"""Attention-level cache methods, per request: PAB and FasterCache, decided as diffusers' hooks decide.

Unlike the block methods, these never skip a block: each attention module (`layers/attention_reuse.py`)
of a request's rows is either run or stood in for, and the rest of every block runs. Per request and per
attention module, as diffusers' hooks keep it per module:

- `pab` (`PyramidAttentionBroadcastHook`): the output is computed on the request's first forward, outside
  the timestep range `low < t < high`, and on every `skip_range`-th forward; in between the last output
  (computed or reused) stands in.
- `fastercache` (`FasterCacheBlockHook` with `is_guidance_distilled`): inside its timestep range the
  output is computed on every `skip_range`-th forward after the first and extrapolated in between from
  the last two outputs, `t + (t - t_prev) * attention_weight`; outside the range it is computed. The
  outputs kept are the last two, extrapolations included.

`t` is the request's timestep (`Schedule.host_timesteps`); the forward count is the request's (each CFG
branch's rows keep their own outputs: rows are never mixed). A module whose kind has no skip range
(PAB's cross-attention by default) always runs. An output is reused only where the call's input shapes
match those it was kept for (a DiT that pads text to the batch's longest may change them): otherwise
the call runs, and counts as computed.

`AttentionReuseScope` applies the decisions during one DiT forward over a batch of requests: a call whose
rows all reuse is not run at all; a call where some rows compute runs for the whole batch and the reusing
rows' outputs are replaced (equal values to running alone; the saving is then only for whole calls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from diffserve.configs.cache_settings import FasterCacheSettings, PabSettings, within_timesteps
from diffserve.layers.attention_reuse import AttentionOutput, ReusableAttention
from diffserve.models.cache_methods.base import Plan, RequestCache
from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.cache_methods.unconditional_branch import UnconditionalBranch

Kind = Literal["spatial", "cross"]
#: An attention call within one forward: the module and how many times it was called before in it.
CallKey = tuple[ReusableAttention, int]


def _rows(output: AttentionOutput, lo: int, hi: int) -> AttentionOutput:
    if isinstance(output, torch.Tensor):
        return output[lo:hi]
    return tuple(None if t is None else t[lo:hi] for t in output)


def _concat(parts: Sequence[AttentionOutput]) -> AttentionOutput:
    if isinstance(parts[0], torch.Tensor):
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
    return tuple(
        None if items[0] is None else items[0] if len(items) == 1 else torch.cat(items)
        for items in zip(*parts, strict=True)
    )


def _rows_of(output: AttentionOutput) -> int:
    first = output if isinstance(output, torch.Tensor) else next(t for t in output if t is not None)
    return int(first.shape[0])


@dataclass
class _Kept:
    """A request's last outputs of one attention call (newest last) and the input shapes they are for."""

    signature: tuple
    outputs: list[AttentionOutput]


class AttentionCacheState(RequestCache):
    """A request's attention-level cache: its kept outputs and this forward's decision per kind."""

    #: Outputs kept per attention call (FasterCache extrapolates from two).
    keeps: int = 1

    def __init__(self, settings: PabSettings | FasterCacheSettings, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.settings = settings
        self._kept: dict[CallKey, _Kept] = {}
        self._forwards = 0
        self._reuse: dict[Kind, bool] = {"spatial": False, "cross": False}
        self._calls_computed = 0
        self._calls_reused = 0

    # -- the batch's side (a block method's questions, answered: the blocks always run) ----------------

    @property
    def kept_states(self) -> int:
        """Hidden states per token kept: `keeps` outputs of about one attention per block."""
        return max(2, self.keeps * self.num_blocks)

    def plan(self, step: int, num_steps: int) -> Plan:
        return Plan.COMPUTE

    @property
    def has_residual(self) -> bool:
        return False

    def reused_residual(self, step: int) -> Streams:
        raise RuntimeError(f"{self.method} reuses attention outputs, never the blocks' residual")

    def store(self, residual: Streams, step: int) -> None:
        return None  # the blocks always run: nothing of theirs is kept

    def record(self, reused: bool) -> None:
        """Count this forward: a step "reused" when any attention call of it was stood in for, or its
        negative branch skipped (`unconditional`); the blocks' counts are the attention calls' (computed,
        reused)."""
        skipped_branch = self.unconditional is not None and self.unconditional.skipping
        self.history.append(self._calls_reused == 0 and not skipped_branch)
        self.blocks_computed += self._calls_computed
        self.blocks_reused += self._calls_reused
        self._calls_computed = self._calls_reused = 0

    def settings_report(self) -> dict[str, Any]:
        return self.settings.to_dict()

    def extra_report(self) -> dict[str, Any]:
        return {"attention_computed": self.blocks_computed, "attention_reused": self.blocks_reused}

    # -- per forward -----------------------------------------------------------------------------------

    def begin_forward(self, timestep: float) -> None:
        """Decide this forward's reuse per kind, at the request's `timestep`."""
        self._reuse = {
            kind: self.decide_kind(kind, self._forwards, timestep) for kind in ("spatial", "cross")
        }
        self._forwards += 1

    def decide_kind(self, kind: Kind, iteration: int, timestep: float) -> bool:
        """Whether this forward's attention of `kind` may be stood in for (`iteration`: forwards before)."""
        raise NotImplementedError

    def reusable(self, kind: Kind) -> bool:
        """Whether attention of `kind` is ever stood in for (if not, nothing of it is kept)."""
        raise NotImplementedError

    def count_computed(self) -> None:
        """Count a call that ran and whose output is not kept (its kind is never reused)."""
        self._calls_computed += 1

    def can_reuse(self, kind: Kind, key: CallKey, signature: tuple, rows: int) -> bool:
        kept = self._kept.get(key)
        return (
            self._reuse[kind]
            and kept is not None
            and len(kept.outputs) >= self.keeps
            and kept.signature == signature
            and _rows_of(kept.outputs[-1]) == rows
        )

    def kept_signature(self, key: CallKey) -> tuple | None:
        """The input shapes of the outputs kept for this call (None: none kept)."""
        kept = self._kept.get(key)
        return None if kept is None else kept.signature

    def stand_in(self, key: CallKey) -> AttentionOutput:
        """The output standing in for this call (only after `can_reuse` said yes)."""
        return self._kept[key].outputs[-1]

    def keep(self, key: CallKey, signature: tuple, output: AttentionOutput, reused: bool) -> None:
        """Keep this call's output (computed or stood in for) and count the call."""
        kept = self._kept.get(key)
        if kept is None or kept.signature != signature:
            # The first output counts as the last `keeps` ones (diffusers' FasterCache starts with two).
            self._kept[key] = _Kept(signature, [output] * self.keeps)
        else:
            kept.outputs = [*kept.outputs, output][-self.keeps :]
        if reused:
            self._calls_reused += 1
        else:
            self._calls_computed += 1


class PabState(AttentionCacheState):
    method = "pab"

    settings: PabSettings

    def _schedule(self, kind: Kind) -> tuple[int | None, tuple[float, ...]]:
        """(skip range, timestep range) of attention of `kind`."""
        s = self.settings
        if kind == "spatial":
            return s.spatial_attention_block_skip_range, s.spatial_attention_timestep_skip_range
        return s.cross_attention_block_skip_range, s.cross_attention_timestep_skip_range

    def decide_kind(self, kind: Kind, iteration: int, timestep: float) -> bool:
        skip_range, bounds = self._schedule(kind)
        if skip_range is None or iteration == 0 or not within_timesteps(timestep, bounds):
            return False
        return iteration % skip_range != 0

    def reusable(self, kind: Kind) -> bool:
        return self._schedule(kind)[0] is not None


class FasterCacheState(AttentionCacheState):
    """FasterCache. On a request with CFG (unless `is_guidance_distilled` is true) it also skips the
    unconditional branch on some steps (`unconditional`, `unconditional_branch.py`); self-attention is
    then stood in for only on those steps, and only the prompt branch's outputs are kept, as diffusers'
    `FasterCacheBlockHook` does once the denoiser runs half the batch."""

    method = "fastercache"
    keeps = 2

    settings: FasterCacheSettings

    def approximate_unconditional(self) -> None:
        """Run this request's CFG with the unconditional-branch approximation (a request with CFG whose
        settings do not say `is_guidance_distilled`)."""
        self.unconditional = UnconditionalBranch(self.settings)

    def _both_branches_run(self) -> bool:
        return self.unconditional is not None and not self.unconditional.skipping

    def decide_kind(self, kind: Kind, iteration: int, timestep: float) -> bool:
        s = self.settings
        if kind != "spatial" or not within_timesteps(timestep, s.spatial_attention_timestep_skip_range):
            return False
        if self._both_branches_run():
            return False
        return not (iteration > 0 and iteration % s.spatial_attention_block_skip_range == 0)

    def reusable(self, kind: Kind) -> bool:
        return kind == "spatial"

    def keep(self, key: CallKey, signature: tuple, output: AttentionOutput, reused: bool) -> None:
        if self._both_branches_run():  # rows: the prompt branch's, then the negative one's
            output = _rows(output, 0, _rows_of(output) // 2)
        super().keep(key, signature, output, reused)

    def stand_in(self, key: CallKey) -> AttentionOutput:
        previous, last = self._kept[key].outputs[-2:]
        weight = self.settings.attention_weight
        if isinstance(last, torch.Tensor):
            assert isinstance(previous, torch.Tensor)
            return last + (last - previous) * weight
        return tuple(None if t is None else t + (t - p) * weight for p, t in zip(previous, last, strict=True))

    def extra_report(self) -> dict[str, Any]:
        report = super().extra_report()
        if self.unconditional is not None:
            report["unconditional_skipped"] = self.unconditional.skipped
        return report


@dataclass(frozen=True)
class ReuseRows:
    """A request's consecutive rows in the DiT batch and its attention cache (None: it never reuses)."""

    state: AttentionCacheState | None
    lo: int
    hi: int


class AttentionReuseScope:
    """The `AttentionReuse` of one DiT forward over a batch (`layers/attention_reuse.py`): which rows
    belong to which request, and which of them the blocks now run on (`running`)."""

    def __init__(self, groups: Sequence[ReuseRows]) -> None:
        self.groups = list(groups)
        self._present = self.groups
        self._calls: dict[ReusableAttention, int] = {}

    @contextmanager
    def running(self, bounds: Sequence[tuple[int, int]] | None) -> Iterator[None]:
        """The blocks run on the batch rows of these requests' `(lo, hi)` bounds, in order (None: all)."""
        saved = self._present
        if bounds is not None:
            wanted = set(bounds)
            self._present = [g for g in self.groups if (g.lo, g.hi) in wanted]
        try:
            yield
        finally:
            self._present = saved

    def _next_key(self, module: ReusableAttention) -> CallKey:
        """The key of the module's next call in this forward, not yet counted as made."""
        return module, self._calls.get(module, 0)

    def _key(self, module: ReusableAttention) -> CallKey:
        """The key of the module's call being made now (counted)."""
        key = self._next_key(module)
        self._calls[module] = key[1] + 1
        return key

    @staticmethod
    def _kind(module: ReusableAttention) -> Kind:
        return "cross" if module.is_cross_attention else "spatial"

    def _all_reuse(self, module: ReusableAttention, signature: tuple) -> CallKey | None:
        """The call's key when every running row reuses this call (None: it must run)."""
        key = self._next_key(module)
        kind = self._kind(module)
        for g in self._present:
            if g.state is None or not g.state.can_reuse(kind, key, signature, g.hi - g.lo):
                return None
        return key

    def _stand_in_all(self, key: CallKey, signature: tuple) -> AttentionOutput:
        self._key(key[0])
        parts = []
        for g in self._present:
            assert g.state is not None
            value = g.state.stand_in(key)
            g.state.keep(key, signature, value, reused=True)
            parts.append(value)
        return _concat(parts)

    def call(
        self, module: ReusableAttention, compute: Callable[[], AttentionOutput], signature: tuple
    ) -> AttentionOutput:
        key = self._all_reuse(module, signature)
        if key is not None:
            return self._stand_in_all(key, signature)
        key = self._key(module)
        kind = self._kind(module)
        output = compute()
        batch = sum(g.hi - g.lo for g in self._present)
        if _rows_of(output) != batch:
            raise RuntimeError(
                f"{type(module).__name__} returned {_rows_of(output)} rows for a batch of {batch}: "
                "attention reuse needs batch rows first"
            )
        parts, offset, replaced = [], 0, False
        for g in self._present:
            rows = g.hi - g.lo
            value = _rows(output, offset, offset + rows)
            offset += rows
            if g.state is None:
                parts.append(value)
                continue
            if not g.state.reusable(kind):
                g.state.count_computed()
                parts.append(value)
                continue
            reused = g.state.can_reuse(kind, key, signature, rows)
            if reused:
                value, replaced = g.state.stand_in(key), True
            g.state.keep(key, signature, value, reused)
            parts.append(value)
        return _concat(parts) if replaced else output

    def reused_output(self, module: ReusableAttention) -> AttentionOutput | None:
        # The block asks before it projects the inputs, so the shapes are not known: the signature kept
        # with the outputs stands for them (the same module, call and rows).
        key = self._next_key(module)
        signatures = set()
        for g in self._present:
            kept = None if g.state is None else g.state.kept_signature(key)
            if kept is None:
                return None
            signatures.add(kept)
        if len(signatures) != 1:
            return None
        signature = signatures.pop()
        if self._all_reuse(module, signature) is None:
            return None
        return self._stand_in_all(key, signature)
