"""`attention(q, k, v)` on (batch, seq, heads, head_dim) tensors, with the backend of the enclosing
`attention_backend_scope` (a `ContextVar`): `sdpa`, `flash_attn` or `sage_attn` (else SDPA, logged).
Compiled code calls the opaque custom op `diffserve::attention`, which reads the scope when the graph
runs: Dynamo cannot trace `ContextVar.get`, and a traced value would be baked into a shared graph."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from enum import Enum

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class AttentionBackend(str, Enum):
    SDPA = "sdpa"
    FLASH_ATTN = "flash_attn"
    SAGE_ATTN = "sage_attn"


_active_backend: ContextVar[AttentionBackend] = ContextVar(
    "diffserve_attention_backend", default=AttentionBackend.SDPA
)
_reported: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        logger.warning(message)


def backend_unavailable_reason(backend: AttentionBackend, device_type: str) -> str | None:
    """Why `backend` cannot run on `device_type` here, or None when it can."""
    if backend is AttentionBackend.SDPA:
        return None
    module = "flash_attn" if backend is AttentionBackend.FLASH_ATTN else "sageattention"
    if importlib.util.find_spec(module) is None:
        return f"attention backend {backend.value!r} requested but the '{module}' package is not installed"
    if device_type not in ("cuda",):
        return f"attention backend {backend.value!r} needs a CUDA/ROCm device, not {device_type!r}"
    return None


def resolve_attention_backend(name: str | None, device_type: str, default: str = "sdpa") -> AttentionBackend:
    """The backend for `name` (None: `default`) on `device_type`; one that cannot run here is logged and
    replaced by SDPA, an unknown name raises ValueError."""
    try:
        wanted = AttentionBackend(name or default)
    except ValueError:
        choices = ", ".join(b.value for b in AttentionBackend)
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}") from None
    reason = backend_unavailable_reason(wanted, device_type)
    if reason is not None:
        logger.warning("%s; using torch SDPA instead", reason)
        wanted = AttentionBackend.SDPA
    logger.info("Attention backend: %s", wanted.value)
    return wanted


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


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v)


def _sage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="NHD")


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    chosen: AttentionBackend,
) -> torch.Tensor:
    """`chosen` over these inputs, or SDPA (logged once) when a fast backend cannot take them."""
    if chosen is not AttentionBackend.SDPA:
        if attn_mask is not None:
            _log_once(f"{chosen.value} does not take an attention mask; using SDPA for masked calls")
        elif q.dtype not in (torch.float16, torch.bfloat16):
            _log_once(f"{chosen.value} needs fp16/bf16 inputs, got {q.dtype}; using SDPA for these calls")
        elif chosen is AttentionBackend.FLASH_ATTN:
            return _flash(q, k, v)
        else:
            return _sage(q, k, v)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask).transpose(1, 2)


@torch.library.custom_op("diffserve::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, backend: str | None
) -> torch.Tensor:
    """`attention()` as compiled graphs call it, the backend read when the graph runs; contiguous, as the
    fake implementation declares."""
    chosen = AttentionBackend(backend) if backend is not None else _active_backend.get()
    return _run(q, k, v, attn_mask, chosen).contiguous()


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
        return _attention_op(q, k, v, attn_mask, name)
    chosen = AttentionBackend(backend) if backend is not None else _active_backend.get()
    return _run(q, k, v, attn_mask, chosen)
