"""Attention modules whose output a cache method may reuse between steps (PAB, FasterCache).

Diffusers' attention-level caches (`pyramid_attention_broadcast`, `faster_cache`) wrap each attention
module's forward: on some steps the module is not run and its cached output (or an extrapolation of its
last outputs) stands in, while the rest of the block runs. Here an attention module opts in by deriving
from `ReusableAttention`; while a forward of the DiT runs under `attention_reuse_scope(reuse)`, each call
of such a module goes through `reuse.call(module, compute)`, which decides per batch row (each row's
request has its own cache) whether to run `compute()` or to stand in for it. Outside a scope, and while
compiled code is being traced, a call is the module's own (one context-variable read).

`is_cross_attention` says which schedule a module follows (diffusers' attribute of the same name): the
self-attention ("spatial") one or the cross-attention one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from typing import Protocol

import torch
from torch import nn

#: What an attention module returns: one tensor, or one per stream (image, text; None for a stream it
#: does not output), batch rows first.
AttentionOutput = torch.Tensor | tuple[torch.Tensor | None, ...]


class AttentionReuse(Protocol):
    """Stands in for attention calls during one DiT forward (`models/cache_methods/attention_level.py`)."""

    def call(
        self, module: ReusableAttention, compute: Callable[[], AttentionOutput], signature: tuple
    ) -> AttentionOutput:
        """The module's output for this call's batch rows: `compute()`'s, or reused for some rows.
        `signature`: the call's input shapes past the batch dimension (a reused output must match)."""
        ...

    def reused_output(self, module: ReusableAttention) -> AttentionOutput | None:
        """For a block that projects its attention's inputs itself (FLUX's single-stream block): the
        output standing in for this call when every row reuses it (the call is then accounted for), so
        the block can skip those projections; None when the call must run (then call the module)."""
        ...


_active: ContextVar[AttentionReuse | None] = ContextVar("diffserve_attention_reuse", default=None)


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensor arguments past their first (batch) dimension, in order; a boolean
    tensor (a key-padding mask) counts as absent: whether the batch pads a request's text is the batch's
    business, and its shape follows from the streams' own."""
    values = [*args, *kwargs.values()]
    return tuple(
        tuple(v.shape[1:]) if isinstance(v, torch.Tensor) and v.dtype != torch.bool else None for v in values
    )


class ReusableAttention(nn.Module):
    """An attention module a cache method may stand in for (see the module docstring)."""

    #: Cross-attention (keys and values from the text) follows the cross-attention schedule.
    is_cross_attention: bool = False

    def __call__(self, *args: object, **kwargs: object) -> AttentionOutput:
        reuse = None if torch.compiler.is_compiling() else _active.get()
        if reuse is None:
            return nn.Module.__call__(self, *args, **kwargs)
        compute = partial(nn.Module.__call__, self, *args, **kwargs)
        return reuse.call(self, compute, input_signature(args, kwargs))


def attention_reuse_active() -> bool:
    """Whether a DiT forward with attention reuse is running here and now (compiled blocks then run
    eagerly: their graphs cannot skip a module)."""
    return _active.get() is not None


def reused_attention_output(module: ReusableAttention) -> AttentionOutput | None:
    """`AttentionReuse.reused_output` of the active scope (None outside one, and while compiled code is
    being traced: a graph cannot read the scope's context variable without breaking, and compiled blocks
    run eagerly whenever a scope is active)."""
    reuse = None if torch.compiler.is_compiling() else _active.get()
    return None if reuse is None else reuse.reused_output(module)


@contextmanager
def attention_reuse_scope(reuse: AttentionReuse | None) -> Iterator[None]:
    """Route the calls of every `ReusableAttention` in this thread/task through `reuse` until the block
    exits (None: none)."""
    token = _active.set(reuse)
    try:
        yield
    finally:
        _active.reset(token)
