"""What a compiled graph may resolve when it is traced rather than when it runs.

Eager code reads the request's scope from `ContextVar`s on every call: the attention backend and hook
(`layers/attention.py`) and the LoRA rows of the batch (`layers/lora_rows.py`). Dynamo cannot trace
`ContextVar.get` (it breaks the graph there), so compiled code calls opaque custom ops that read the
scope when the graph runs (`diffserve::attention`, `diffserve::lora_linear`): correct for any scope, but
inductor then cannot lower or fuse around them (SDPA stays behind an op boundary, and every Linear of a
LoRA-wrapped DiT runs eagerly inside the op, without its bias fused, even in batches without LoRA).

`resolved_for_trace(scope)` mirrors the scope into a thread-local for the duration of one synchronous
call into compiled code (`runtime/compile.py` enters it around each compiled block call). Code under
`torch.compiler.is_compiling()` reads the mirror through `traced_attention_backend()` and
`traced_lora_rows()`; dynamo guards on every value it reads, so a graph traced under SDPA with no LoRA
rows runs only while that holds, and a call under another backend, or with LoRA rows, gets (compiles
once) its own graph: one graph per (backend, wrapper set). Nothing here is process-wide: the mirror is
per thread, set only inside a call that runs start to end on that thread, and restored after it.

Outside such a call (a model compiled by other code, the CUDA-graph runner's own compiled blocks) nothing
is resolved: both functions return None and the opaque ops read the scope at run time, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["TraceScope", "resolved_for_trace", "traced_attention_backend", "traced_lora_rows"]


@dataclass(frozen=True)
class TraceScope:
    """The scope of one call into compiled code, as tracing may resolve it.

    `attention_backend`: the active `AttentionBackend`'s value; `attention_hooked`: an attention hook is
    active (the CUDA-graph runner's break points: attention must stay the opaque op, which runs the hook);
    `lora_rows`: some row of the batch applies a LoRA adapter."""

    attention_backend: str
    attention_hooked: bool
    lora_rows: bool


class _Mirror(threading.local):
    """Per-thread mirror. Attributes are set per instance (per thread, in `__init__`), never as class
    attributes: dynamo guards on instance attributes of a thread-local, but reads a class attribute as a
    constant without a guard (checked with torch 2.13)."""

    def __init__(self) -> None:
        self.active = False
        self.attention_backend: str | None = None
        self.attention_hooked = False
        self.lora_rows = False


_mirror = _Mirror()


@contextmanager
def resolved_for_trace(scope: TraceScope) -> Iterator[None]:
    """Let compiled code entered in this block resolve `scope` at trace time (guarded); nests and restores
    the enclosing mirror on exit, errors included."""
    saved = (_mirror.active, _mirror.attention_backend, _mirror.attention_hooked, _mirror.lora_rows)
    _mirror.active = True
    _mirror.attention_backend = scope.attention_backend
    _mirror.attention_hooked = scope.attention_hooked
    _mirror.lora_rows = scope.lora_rows
    try:
        yield
    finally:
        _mirror.active, _mirror.attention_backend, _mirror.attention_hooked, _mirror.lora_rows = saved


def traced_attention_backend() -> str | None:
    """For code being traced: the attention backend's value the graph may call directly, or None when
    the graph must read the scope when it runs (no mirrored call, or an attention hook is active)."""
    if not _mirror.active or _mirror.attention_hooked:
        return None
    return _mirror.attention_backend


def traced_lora_rows() -> bool | None:
    """For code being traced: whether a LoRA adapter applies to some row of the batch (False: every
    `LoraLinear` may run as its base Linear), or None when not resolved (no mirrored call)."""
    if not _mirror.active:
        return None
    return _mirror.lora_rows
