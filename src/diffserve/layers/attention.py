"""`attention(q, k, v)` on (batch, seq, heads, head_dim) tensors, with the backend of the enclosing
`attention_backend_scope` (a `ContextVar`): one of `layers/attention_backends.py`'s kernels (SDPA,
FlashAttention 3 / 2, SageAttention, cuDNN or efficient SDPA), chosen per engine by
`resolve_attention_backend`. A call the active kernel cannot take (a mask, a dtype, a head dim) runs on
SDPA, logged once. Compiled code calls the opaque custom op `diffserve::attention`, which reads the scope
when the graph runs (Dynamo cannot trace `ContextVar.get`), except inside `--compile`'s scoped calls,
where the backend is resolved at trace time and guarded (`layers/trace_scope.py`): SDPA is then traced
as itself, so inductor can lower it and fuse around it.

`attention_hook_scope` lets the breakable CUDA graphs (`runtime/cuda_graph/`) take over every attention
call in its block: the call then becomes a break point between captured segments (the hook runs the
kernel itself, through `run_attention_kernel`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch

from diffserve.layers import attention_backends
from diffserve.layers.attention_backends import AUTO, SPECS, AttentionBackend, DeviceFacts, sdpa
from diffserve.layers.trace_scope import traced_attention_backend

logger = logging.getLogger(__name__)

__all__ = [
    "AttentionBackend",
    "AttentionHook",
    "active_attention_backend",
    "attention",
    "attention_backend_scope",
    "attention_hook_active",
    "attention_hook_scope",
    "resolve_attention_backend",
    "run_attention_kernel",
]


class AttentionHook(Protocol):
    """Runs one attention call in place of the kernel dispatch (`attention_hook_scope`)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        backend: AttentionBackend,
    ) -> torch.Tensor: ...


_active_backend: ContextVar[AttentionBackend] = ContextVar(
    "diffserve_attention_backend", default=AttentionBackend.SDPA
)
_active_hook: ContextVar[AttentionHook | None] = ContextVar("diffserve_attention_hook", default=None)
_reported: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        logger.warning(message)


def resolve_attention_backend(
    name: str | None,
    device_type: str,
    default: str = AUTO,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    facts: DeviceFacts | None = None,
) -> AttentionBackend:
    """The backend for `name` (None: `default`, normally `auto`) on the device `device_type` (`device`
    with its compute capability, `dtype` the model's, or `facts` given whole), logged with the reasons
    the others were not taken. A named backend that cannot run here raises
    `AttentionBackendUnavailableError` (a ValueError), as does an unknown name."""
    if facts is None:
        facts = DeviceFacts.of(device, dtype) if device is not None else DeviceFacts(device_type, dtype=dtype)
    selection = attention_backends.select_attention_backend(name or default, facts)
    logger.info("Attention backend: %s", selection.describe())
    return selection.backend


@contextmanager
def attention_backend_scope(backend: AttentionBackend | str) -> Iterator[AttentionBackend]:
    """Make `backend` the one `attention()` uses in this thread/task until the block exits (scopes nest)."""
    chosen = AttentionBackend(backend)
    token = _active_backend.set(chosen)
    try:
        yield chosen
    finally:
        _active_backend.reset(token)


def active_attention_backend() -> AttentionBackend:
    """The backend `attention()` uses here and now: the innermost scope's, or SDPA outside any scope."""
    return _active_backend.get()


def attention_hook_active() -> bool:
    """Whether an `attention_hook_scope` with a hook is active here and now."""
    return _active_hook.get() is not None


@contextmanager
def attention_hook_scope(hook: AttentionHook | None) -> Iterator[None]:
    """Route every `attention()` call in this thread/task to `hook` until the block exits (None: none)."""
    token = _active_hook.set(hook)
    try:
        yield
    finally:
        _active_hook.reset(token)


def run_attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    chosen: AttentionBackend,
) -> torch.Tensor:
    """`chosen`'s kernel over these inputs, or SDPA (logged once) when the kernel cannot take them."""
    if chosen is not AttentionBackend.SDPA:
        spec = SPECS[chosen]
        reason = spec.call_unsupported(q, k, v, attn_mask)
        if reason is None and spec.package is not None:
            return spec.run(q, k, v, attn_mask)
        if reason is None:
            # SDPA pinned to one of its kernels: torch knows best whether that kernel takes these inputs,
            # and says so by refusing ("No available kernel").
            try:
                return spec.run(q, k, v, attn_mask)
            except RuntimeError as exc:
                reason = f"refused these inputs ({str(exc).strip().splitlines()[0][:160]})"
        _log_once(f"{chosen.value} {reason}; using SDPA for these calls")
    return sdpa(q, k, v, attn_mask)


def _active_runner() -> AttentionHook:
    """What runs an attention call now: the active hook (`attention_hook_scope`), else the kernel itself
    (`run_attention_kernel`)."""
    hook = _active_hook.get()
    return run_attention_kernel if hook is None else hook


@torch.library.custom_op("diffserve::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, backend: str | None
) -> torch.Tensor:
    """`attention()` as compiled graphs call it, the backend read when the graph runs; contiguous, as the
    fake implementation declares."""
    chosen = AttentionBackend(backend) if backend is not None else _active_backend.get()
    return _active_runner()(q, k, v, attn_mask, chosen).contiguous()


@_attention_op.register_fake
def _attention_op_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, backend: str | None
) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    backend: AttentionBackend | str | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention over (batch, seq, heads, head_dim) tensors, in the same layout;
    `backend` overrides the active scope's for this call."""
    if torch.compiler.is_compiling():
        name = None if backend is None else AttentionBackend(backend).value
        # Resolved at trace time inside `--compile`'s scoped calls (layers/trace_scope.py, guarded: another
        # backend gets its own graph): SDPA is traced as itself, so inductor lowers it and fuses around it;
        # the other kernels stay the opaque op with their name. Unresolved: the op reads the scope at run time.
        traced = traced_attention_backend()
        if traced is not None:
            name = name or traced
            if name == AttentionBackend.SDPA.value:
                return sdpa(q, k, v, attn_mask)
        return _attention_op(q, k, v, attn_mask, name)
    chosen = AttentionBackend(backend) if backend is not None else _active_backend.get()
    return _active_runner()(q, k, v, attn_mask, chosen)
