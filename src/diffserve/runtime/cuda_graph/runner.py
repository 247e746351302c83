"""`GraphRunner`: breakable CUDA graphs around one DiT (`--enable-cuda-graph`).

A DiT call is padded to its buckets (`padders.py`, `buckets.py`) and looked up by its signature; a call
seen for the first time is captured (while capture is on: the warm-up, or every call when no warm-up
sizes were given), then replayed; a call that cannot be captured runs eager, with one log line per kind
of reason. What is captured is the DiT's repeated blocks (`runtime/compile.py: find_block_lists`):

    DiT forward (eager: embedders, RoPE tables, masks, output head; cheap and shape-keyed)
      block 0:  [copy changed inputs into static buffers] segment 0.0 | break | segment 0.1 | ...
      block 1:  ...                                        (its input is block 0's static output)

Each block call is one or more segments (CUDA graphs); a segment ends at an explicit break point: an
`attention()` call, for padders whose padding differs between replays of one graph (`AttentionSpan`:
Qwen-Image's real text length inside its token bucket). A break runs attention eagerly between two
segments, from static buffers the previous segment filled, on the real tokens only (the span is
replay-local metadata, taken from the call being replayed), and writes a static buffer the next segment
reads. Padders whose calls are fully determined by the bucket (FLUX, Z-Image) have no breaks: attention
is captured with the rest.

Static buffers: a block's tensor inputs that come from outside the captured blocks (the eager prologue's
latents, timestep embeddings, RoPE tables, masks) are copied once per replay into buffers made at
capture; a block's outputs are copied, inside its last segment, into buffers shared by every block
(per output position and shape), which is what the next block reads. So one captured call holds one
block's working memory plus the shared buffers, not every block's activations. (A DiT that kept an early
block's output for a later one would break this; none does, and the dry-run tests would catch it.)

Replay checks that the model calls the same blocks with the same non-tensor arguments and shapes as at
capture (`CaptureMismatchError` otherwise: a bug, never silently eager). Where the capture backend cannot
replay (`DryRunBackend`, no CUDA), each block is recomputed eagerly through the same static buffers and
break points, so everything but the CUDA calls runs in the tests.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from diffserve.distributed.state import current_parallel_state
from diffserve.layers.attention import AttentionBackend, attention_hook_scope, run_attention_kernel
from diffserve.layers.lora_rows import current_lora_rows
from diffserve.runtime import compile as compile_settings
from diffserve.runtime.compile import find_block_lists
from diffserve.runtime.cuda_graph.backends import CaptureBackend
from diffserve.runtime.cuda_graph.buckets import Buckets
from diffserve.runtime.cuda_graph.padders import AttentionSpan, PaddedCall, PromptPadder

logger = logging.getLogger("diffserve.cuda_graph")

#: How the log lines start (SGLang's say "[Diffusion BCG]").
PREFIX = "[BCG]"
#: Distinct one-time log lines kept (so a server seeing endless new shapes does not grow the set).
MAX_LOGGED = 1024


class CaptureMismatchError(RuntimeError):
    """A replayed call did not follow its capture (other blocks, arguments or shapes): a bug."""


def attend_real_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    backend: AttentionBackend,
    span: AttentionSpan | None,
) -> torch.Tensor:
    """Attention as the unpadded call computes it: the padder's `span` (inserted text padding) is
    dropped from queries, keys, values and mask for calls over the joint sequence, the kernel runs on
    the rest, and the dropped query rows come back as zeros (nothing real reads them)."""
    if span is None or k.shape[1] != span.joint_length:
        return run_attention_kernel(q, k, v, mask, backend)
    start, stop = span.start, span.stop

    def drop(t: torch.Tensor, dim: int) -> torch.Tensor:
        if stop == start:
            return t
        return torch.cat([t.narrow(dim, 0, start), t.narrow(dim, stop, t.shape[dim] - stop)], dim=dim)

    joint_queries = q.shape[1] == span.joint_length
    q_real = drop(q, 1) if joint_queries else q
    mask_real = None
    if mask is not None and not span.mask_made:
        mask_real = drop(mask, mask.ndim - 1)
        if mask.ndim >= 2 and mask.shape[-2] == span.joint_length:
            mask_real = drop(mask_real, mask.ndim - 2)
    out = run_attention_kernel(q_real, drop(k, 1), drop(v, 1), mask_real, backend)
    if not joint_queries or stop == start:
        return out
    full = out.new_zeros(*q.shape[:-1], v.shape[-1])
    full[:, :start] = out[:, :start]
    full[:, stop:] = out[:, start:]
    return full


@dataclass
class BreakPoint:
    """One attention call between two segments: its inputs and output live in static buffers."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    out: torch.Tensor
    backend: AttentionBackend

    def shapes(self) -> tuple[Any, ...]:
        return tuple(None if t is None else tuple(t.shape) for t in (self.q, self.k, self.v, self.mask))

    def run(self, span: AttentionSpan | None) -> None:
        """Attention over the buffers with this replay's span, into `out`."""
        self.out.copy_(attend_real_tokens(self.q, self.k, self.v, self.mask, self.backend, span))


@dataclass
class BlockCall:
    """One block invocation of a captured call: what its segments read (`statics`, per leaf of its
    arguments; None for a non-tensor leaf, whose value is in `constants`), its segments and break
    points in order, and its outputs (static tensors)."""

    block: nn.Module
    spec: TreeSpec
    statics: list[torch.Tensor | None]
    constants: tuple[Any, ...]
    values: list[Any]  # the non-tensor leaves as they were (None for tensors)
    items: list[Any] = field(default_factory=list)
    outputs: Any = None

    @property
    def breaks(self) -> list[BreakPoint]:
        return [item for item in self.items if isinstance(item, BreakPoint)]


@dataclass
class CapturedCall:
    """A captured DiT call: its key, a description for logs, and its block calls in order."""

    key: tuple[Any, ...]
    description: str
    blocks: list[BlockCall] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def segments(self) -> int:
        return sum(len(b.items) - len(b.breaks) for b in self.blocks)

    @property
    def breaks(self) -> int:
        return sum(len(b.breaks) for b in self.blocks)


@dataclass
class _CallState:
    """One DiT call going through a runner's blocks (capture or replay)."""

    runner: GraphRunner
    mode: str  # "capture" | "replay"
    record: CapturedCall
    padded: PaddedCall
    cursor: int = 0
    statics: dict[int, torch.Tensor] = field(default_factory=dict)  # capture: id(eager) -> static
    produced: set[int] = field(default_factory=set)  # capture: ids of the blocks' static outputs
    copied: set[tuple[int, int]] = field(default_factory=set)  # replay: (id(eager), id(static)) done
    keepalive: list[torch.Tensor] = field(default_factory=list)  # the eager tensors whose ids are used
    block: BlockCall | None = None
    break_cursor: int = 0


#: One attention call's (q, k, v, mask), as an attention hook receives them.
_AttentionInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]

_STATE: ContextVar[_CallState | None] = ContextVar("diffserve_cuda_graph_call", default=None)
_TENSOR = "<tensor>"


def _constant(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


class GraphRunner:
    """Breakable CUDA graphs for `dit` (see the module docstring). `install()` routes the DiT's forward
    and its blocks' through the runner; `capture_enabled` says whether an unseen shape is captured
    (warm-up) or runs eager (logged as MISSED)."""

    def __init__(
        self,
        dit: nn.Module,
        padder: PromptPadder,
        backend: CaptureBackend,
        buckets: Buckets | None = None,
        name: str = "transformer",
        capture_all_buckets: bool = True,
    ) -> None:
        self.dit, self.padder, self.backend = dit, padder, backend
        self.buckets = buckets or Buckets()
        self.name = name
        #: While capture is on, a call also captures every larger bucket of its shape (the warm-up's
        #: short prompts then cover the longer ones).
        self.capture_all_buckets = capture_all_buckets
        self.capture_enabled = True
        self.graphs: dict[tuple[Any, ...], CapturedCall] = {}
        self.failed: dict[tuple[Any, ...], str] = {}
        self.stats: Counter[str] = Counter()
        self.blocks = [block for _, blocks in find_block_lists(dit) for block in blocks]
        if not self.blocks:
            raise ValueError(f"{name} ({type(dit).__name__}) has no repeated block list to capture")
        self.original_forward: Callable[..., Any] = dit.forward
        self._parameters = inspect.signature(self.original_forward)
        self._inner: dict[int, Callable[..., Any]] = {}
        self._compiled: dict[int, Callable[..., Any]] = {}
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._logged: set[Any] = set()
        self.installed = False

    # -- installing -------------------------------------------------------------------------------

    def install(self) -> GraphRunner:
        """Route the DiT's and its blocks' forwards through the runner (instance attributes: the
        state-dict names stay). A block compiled by `--compile` keeps its compiled code, called by the
        runner."""
        if self.installed:
            return self
        for block in self.blocks:
            inner: Callable[..., Any] = block.forward
            compiled = getattr(block, "_compiled_call_impl", None)
            if compiled is not None:
                self._compiled[id(block)] = compiled
                block._compiled_call_impl = None
                inner = torch.compile(inner, backend=compile_settings.BACKEND, dynamic=True)
            self._inner[id(block)] = inner
            block.forward = functools.partial(self._block_call, block)
        self.dit.forward = self.forward
        self.installed = True
        return self

    def uninstall(self) -> None:
        """Give the DiT and its blocks their own forwards back."""
        if not self.installed:
            return
        for block in self.blocks:
            del block.forward
            if id(block) in self._compiled:
                block._compiled_call_impl = self._compiled[id(block)]
        del self.dit.forward
        self.installed = False

    # -- the DiT call -----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The DiT's forward: replayed from a captured graph where possible, else eager (logged)."""
        call = dict(self._parameters.bind(*args, **kwargs).arguments)
        reason = self._eager_reason(call)
        if reason is not None:
            self.stats["eager"] += 1
            self._log_once(f"{PREFIX} {self.name}: eager ({reason})")
            return self.original_forward(**call)
        rows = self.padder.batch_size(call)
        tokens = self.padder.text_length(call)
        batch_bucket = self.buckets.batch_bucket(rows)
        token_bucket = None if tokens is None else self.buckets.token_bucket(tokens)
        if batch_bucket is None or (tokens is not None and token_bucket is None):
            self.stats["fallback"] += 1
            if batch_bucket is None:
                why = f"{rows} rows are more than the largest batch bucket ({self.buckets.batch[-1]})"
            else:
                why = f"a prompt of {tokens} text tokens is longer than the largest token bucket ({self.buckets.tokens[-1]})"
            self._log_once(f"{PREFIX} {self.name}: eager fallback: {why}")
            return self.original_forward(**call)
        if self.capture_enabled and self.capture_all_buckets:
            self._capture_larger_buckets(call, rows, tokens)
        padded = self.padder.pad(call, batch_bucket, token_bucket)
        key = self.padder.signature(padded)
        record = self.graphs.get(key)
        if record is None:
            if key in self.failed or not self.capture_enabled:
                self.stats["missed"] += 1
                why = "its capture failed" if key in self.failed else "not captured at warm-up"
                self._log_once(f"{PREFIX} {self.name}: MISSED {self.describe(padded)} ({why}): eager", key)
                return self.original_forward(**call)
            record = self._capture(key, padded)
            if record is None:
                self.stats["missed"] += 1
                return self.original_forward(**call)
        output = self._replay(record, padded)
        self.stats["replayed"] += 1
        return self.padder.unpad(output, padded)

    def describe(self, padded: PaddedCall) -> str:
        """A padded call's buckets, for logs: "batch bucket 2 (1 row), token bucket 64 (7 tokens)"."""
        text = f"batch bucket {padded.batch_bucket} ({padded.real_batch} row{'s' * (padded.real_batch != 1)})"
        if padded.token_bucket is not None:
            text += f", token bucket {padded.token_bucket} ({padded.text_length} tokens)"
        elif padded.extra:
            text += f", {self.padder.contract} text {list(padded.extra)}"
        else:
            text += f", {self.padder.contract} text"
        return text

    def summary(self) -> dict[str, int]:
        """Counts so far: graphs captured, calls replayed, missed (unseen shape or failed capture),
        fallback (over a bucket limit), eager (a feature that cannot be captured)."""
        return {
            "captured": len(self.graphs),
            "replayed": self.stats["replayed"],
            "missed": self.stats["missed"],
            "fallback": self.stats["fallback"],
            "eager": self.stats["eager"],
            "capture_failed": len(self.failed),
        }

    def _eager_reason(self, call: dict[str, Any]) -> str | None:
        """Why this call cannot replay a graph at all, or None."""
        if call.get("step_cache") is not None:
            return "an approximate quality tier's step cache reuses block outputs between steps"
        if call.get("controlnet_residuals") or call.get("controlnet_block_samples") is not None:
            return "ControlNet residuals (their rows and samples change with every batch)"
        if torch.is_grad_enabled():
            return "autograd is on"
        rows = current_lora_rows()
        if rows is not None and rows.active:
            return "per-request LoRA adapters (their row map is read on the host)"
        state = current_parallel_state()
        if state is not None and state.world_size > 1:
            return "several ranks (their collectives are not captured yet)"
        return None

    def _log_once(self, message: str, key: Any = None) -> None:
        """Log `message` the first time it (or, given, `key`: one line per captured shape) comes up."""
        seen = message if key is None else key
        if seen not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add(seen)
            logger.info(message)

    # -- capture ----------------------------------------------------------------------------------

    def _capture_larger_buckets(self, call: dict[str, Any], rows: int, tokens: int | None) -> None:
        """Capture every batch bucket >= `rows` and token bucket >= `tokens` of this call's shape."""
        token_buckets = [None] if tokens is None else [t for t in self.buckets.tokens if t >= tokens]
        for batch_bucket in (b for b in self.buckets.batch if b >= rows):
            for token_bucket in token_buckets:
                padded = self.padder.pad(call, batch_bucket, token_bucket)
                key = self.padder.signature(padded)
                if key not in self.graphs and key not in self.failed:
                    self._capture(key, padded)

    def _capture(self, key: tuple[Any, ...], padded: PaddedCall) -> CapturedCall | None:
        """Capture the padded call (after one eager run of it: lazily built tables, allocator growth,
        kernel set-up happen outside the capture); None, logged, when the capture fails."""
        description = self.describe(padded)
        start = time.perf_counter()
        record = CapturedCall(key, description)
        try:
            self.original_forward(**padded.call)
            state = _CallState(self, "capture", record, padded)
            with self.backend.capture_scope():
                token = _STATE.set(state)
                try:
                    self.original_forward(**padded.call)
                finally:
                    _STATE.reset(token)
        except Exception as exc:  # a capture failure costs this shape its graph, not the request
            self.failed[key] = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "%s %s: capture of %s failed (%s); it runs eager", PREFIX, self.name, description, exc
            )
            return None
        record.seconds = time.perf_counter() - start
        self.graphs[key] = record
        logger.info(
            "%s %s: captured %s: %d block calls, %d %s, %d attention breaks in %.2f s",
            PREFIX, self.name, description, len(record.blocks), record.segments,
            "graphs" if not self.backend.records_only else "segments (dry run)", record.breaks, record.seconds,
        )  # fmt: skip
        return record

    def _buffer(
        self,
        role: tuple[Any, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        stride: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A static buffer shared by every block (and captured call): one per role, shape, strides and
        dtype (`stride` None: contiguous)."""
        key = (*role, tuple(shape), stride, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None:
            if stride is not None:
                buffer = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            else:
                buffer = torch.empty(shape, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer

    def _shared_outputs(self, output: Any, statics: list[torch.Tensor | None]) -> Any:
        """The block's output with each tensor copied into its shared buffer (one that is an input of
        the block itself stays as it is)."""
        leaves, spec = tree_flatten(output)
        shared = []
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and not any(leaf is s for s in statics):
                buffer = self._buffer(("out", position), tuple(leaf.shape), leaf.dtype, leaf.device)
                buffer.copy_(leaf)
                leaf = buffer
            shared.append(leaf)
        return tree_unflatten(shared, spec)

    def _capture_block(
        self, state: _CallState, block: nn.Module, inner: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        statics: list[torch.Tensor | None] = []
        constants: list[Any] = []
        call_leaves: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                static = state.statics.get(id(leaf))
                if static is None:
                    if id(leaf) in state.produced:
                        static = leaf  # an earlier block's static output
                    else:
                        static = leaf.clone()  # an input from outside the blocks: copied per replay
                        state.statics[id(leaf)] = static
                        state.keepalive.append(leaf)
                statics.append(static)
                constants.append(_TENSOR)
                call_leaves.append(static)
            else:
                statics.append(None)
                constants.append(_constant(leaf))
                call_leaves.append(leaf)
        values = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        record = BlockCall(block, spec, statics, tuple(constants), values)
        state.block = record
        static_args, static_kwargs = tree_unflatten(call_leaves, spec)
        hook = self._attention_break if self.padder.breaks_at_attention else None
        self.backend.begin_segment()
        ended = False
        try:
            with attention_hook_scope(hook):
                output = self._shared_outputs(inner(*static_args, **static_kwargs), statics)
            record.items.append(self.backend.end_segment())
            ended = True
        finally:
            if not ended:
                with suppress(Exception):  # the original error is the one to report
                    self.backend.end_segment()
        record.outputs = output
        state.produced.update(id(t) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))
        state.record.blocks.append(record)
        return output

    def _attention_break(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The attention hook inside a block (an `AttentionHook`): at capture a break point recorded, at
        a dry-run replay the captured one run."""
        state = _STATE.get()
        assert state is not None and state.block is not None
        if state.mode == "capture":
            return self._capture_break(state, state.block, (q, k, v, mask), backend)
        return self._replay_break(state, state.block, (q, k, v, mask), backend)

    def _capture_break(
        self, state: _CallState, block: BlockCall, inputs: _AttentionInputs, backend: AttentionBackend
    ) -> torch.Tensor:
        """At capture: end the segment after copying the attention inputs into static buffers, record
        a break point, start the next segment, and hand the blocks the break's output buffer."""
        q, k, v, mask = inputs
        buffers = []
        for role, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
            if t is None:
                buffers.append(None)
                continue
            # The strides of the eager call's inputs, so the kernel sees the layout it sees eagerly.
            buffer = self._buffer(("break", role), tuple(t.shape), t.dtype, t.device, tuple(t.stride()))
            buffer.copy_(t)
            buffers.append(buffer)
        block.items.append(self.backend.end_segment())
        out = self._buffer(("break", "out"), (*q.shape[:-1], v.shape[-1]), q.dtype, q.device)
        point = BreakPoint(buffers[0], buffers[1], buffers[2], buffers[3], out, backend)
        block.items.append(point)
        if self.backend.records_only:  # the dry run executes as it records
            point.run(state.padded.span)
        self.backend.begin_segment()
        return out

    # -- replay -----------------------------------------------------------------------------------

    def _replay(self, record: CapturedCall, padded: PaddedCall) -> Any:
        state = _CallState(self, "replay", record, padded)
        token = _STATE.set(state)
        try:
            output = self.original_forward(**padded.call)
        finally:
            _STATE.reset(token)
        if state.cursor != len(record.blocks):
            raise CaptureMismatchError(
                f"{self.name}: the replay of {record.description} called {state.cursor} blocks, the capture "
                f"{len(record.blocks)}"
            )
        return output

    def _block_call(self, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """A block's forward while the runner is installed."""
        inner = self._inner[id(block)]
        state = _STATE.get()
        if state is None or state.runner is not self:
            return inner(*args, **kwargs)
        if state.mode == "capture":
            return self._capture_block(state, block, inner, args, kwargs)
        return self._replay_block(state, block, inner, args, kwargs)

    def _replay_block(
        self, state: _CallState, block: nn.Module, inner: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        record_index = state.cursor
        if record_index >= len(state.record.blocks):
            raise CaptureMismatchError(f"{self.name}: the replay calls more blocks than the capture did")
        record = state.record.blocks[record_index]
        state.cursor += 1
        leaves, spec = tree_flatten((args, kwargs))
        if record.block is not block or spec != record.spec:
            raise CaptureMismatchError(
                f"{self.name}: block call {record_index} of {state.record.description} differs from its capture "
                f"({type(block).__name__} with other arguments)"
            )
        for position, (leaf, static, constant) in enumerate(
            zip(leaves, record.statics, record.constants, strict=True)
        ):
            if static is None:
                if _constant(leaf) != constant:
                    raise CaptureMismatchError(
                        f"{self.name}: block call {record_index}, argument {position}: {leaf!r} was {constant!r} "
                        "at capture"
                    )
                continue
            if leaf is static:
                continue
            if not isinstance(leaf, torch.Tensor) or leaf.shape != static.shape or leaf.dtype != static.dtype:
                raise CaptureMismatchError(
                    f"{self.name}: block call {record_index}, argument {position}: "
                    f"{getattr(leaf, 'shape', leaf)} does not fit the captured {tuple(static.shape)}"
                )
            pair = (id(leaf), id(static))
            if pair not in state.copied:
                static.copy_(leaf)
                state.copied.add(pair)
                state.keepalive.append(leaf)
        span = state.padded.span
        if not self.backend.records_only:
            for item in record.items:
                if isinstance(item, BreakPoint):
                    item.run(span)
                else:
                    self.backend.replay(item)
            return record.outputs
        return self._recompute_block(state, record, inner)

    def _recompute_block(self, state: _CallState, record: BlockCall, inner: Callable[..., Any]) -> Any:
        """Dry-run replay: the block eagerly over its static buffers, its breaks checked against the
        capture and run from their buffers, its outputs written into the captured output tensors."""
        static_args, static_kwargs = tree_unflatten(
            [s if s is not None else value for s, value in zip(record.statics, record.values, strict=True)],
            record.spec,
        )
        state.block, state.break_cursor = record, 0
        hook = self._attention_break if record.breaks else None
        with attention_hook_scope(hook):
            output = inner(*static_args, **static_kwargs)
        if state.break_cursor != len(record.breaks):
            raise CaptureMismatchError(
                f"{self.name}: a block made {state.break_cursor} attention calls, {len(record.breaks)} at capture"
            )
        new_leaves, new_spec = tree_flatten(output)
        old_leaves, old_spec = tree_flatten(record.outputs)
        if new_spec != old_spec:
            raise CaptureMismatchError(f"{self.name}: a block returned another structure than at capture")
        for new, old in zip(new_leaves, old_leaves, strict=True):
            if isinstance(old, torch.Tensor) and new is not old:
                old.copy_(new)
        return record.outputs

    def _replay_break(
        self, state: _CallState, block: BlockCall, inputs: _AttentionInputs, backend: AttentionBackend
    ) -> torch.Tensor:
        """At a dry-run replay: the block's next break point, checked against these inputs, run from its
        buffers after copying them in."""
        q, k, v, mask = inputs
        breaks = block.breaks
        if state.break_cursor >= len(breaks):
            raise CaptureMismatchError(f"{self.name}: a block made more attention calls than at capture")
        point = breaks[state.break_cursor]
        state.break_cursor += 1
        shapes = tuple(None if t is None else tuple(t.shape) for t in (q, k, v, mask))
        if shapes != point.shapes() or backend is not point.backend:
            raise CaptureMismatchError(
                f"{self.name}: attention call {state.break_cursor - 1} has shapes {shapes} ({backend.value}), "
                f"{point.shapes()} ({point.backend.value}) at capture"
            )
        for buffer, t in ((point.q, q), (point.k, k), (point.v, v), (point.mask, mask)):
            if buffer is not None and t is not None:
                buffer.copy_(t)
        point.run(state.padded.span)
        return point.out
