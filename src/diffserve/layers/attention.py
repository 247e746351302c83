"""One attention entry point with a backend selector.

All native models call `attention(q, k, v)` with tensors laid out (batch, seq, heads, head_dim),
the layout projections produce without a copy. Backends:

- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` (every platform; the default).
- `flash_attn`: the flash-attn package (used only when importable, asked for, and the inputs suit it).
- `sage_attn`: the sageattention package (same rules).

An unavailable backend that was asked for is not used; the reason is logged once and SDPA runs.
"""

from __future__ import annotations

import importlib.util
import logging
from enum import Enum

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class AttentionBackend(str, Enum):
    SDPA = "sdpa"
    FLASH_ATTN = "flash_attn"
    SAGE_ATTN = "sage_attn"


_selected: AttentionBackend = AttentionBackend.SDPA
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


def select_attention_backend(name: str | None, device_type: str, default: str = "sdpa") -> AttentionBackend:
    """Set the process-wide backend from a user choice (None: the platform default). Logs the choice."""
    global _selected
    try:
        wanted = AttentionBackend(name or default)
    except ValueError:
        choices = ", ".join(b.value for b in AttentionBackend)
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}") from None
    reason = backend_unavailable_reason(wanted, device_type)
    if reason is not None:
        logger.warning("%s; using torch SDPA instead", reason)
        wanted = AttentionBackend.SDPA
    _selected = wanted
    logger.info("Attention backend: %s", _selected.value)
    return _selected


def selected_attention_backend() -> AttentionBackend:
    return _selected


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask
    )
    return out.transpose(1, 2)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v)


def _sage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="NHD")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    backend: AttentionBackend | str | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention over (batch, seq, heads, head_dim) tensors; returns the same layout."""
    chosen = AttentionBackend(backend) if backend is not None else _selected
    if chosen is not AttentionBackend.SDPA:
        if attn_mask is not None:
            _log_once(f"{chosen.value} does not take an attention mask; using SDPA for masked calls")
        elif q.dtype not in (torch.float16, torch.bfloat16):
            _log_once(f"{chosen.value} needs fp16/bf16 inputs, got {q.dtype}; using SDPA for these calls")
        elif chosen is AttentionBackend.FLASH_ATTN:
            return _flash(q, k, v)
        else:
            return _sage(q, k, v)
    return _sdpa(q, k, v, attn_mask)
