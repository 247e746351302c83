"""Each attention kernel this GPU can run (`layers/attention_backends.py`) against torch's SDPA on the same
bf16 inputs: FlashAttention 3 and 2, cuDNN and efficient SDPA within bf16 rounding, SageAttention (8-bit QK)
within its looser bound; the kernels this machine cannot run skip, saying why (not installed, other GPU)."""

from __future__ import annotations

import pytest
import torch

from diffserve.layers.attention import attention
from diffserve.layers.attention_backends import (
    AttentionBackend,
    AttentionBackendUnavailableError,
    DeviceFacts,
    select_attention_backend,
)
from diffserve.testing.parity import cosine

pytestmark = pytest.mark.gpu

#: Exact kernels differ from SDPA only in bf16 summation order; SageAttention quantizes Q and K to int8.
MIN_COSINE = {AttentionBackend.SAGE_ATTN: 0.99}
DEFAULT_MIN_COSINE = 0.9995


@pytest.mark.parametrize(
    "backend", [b for b in AttentionBackend if b is not AttentionBackend.SDPA], ids=lambda b: b.value
)
@pytest.mark.parametrize(("seq", "kv_seq"), [(1024, 1024), (333, 777)], ids=["self", "cross-odd"])
def test_backend_matches_sdpa(device: torch.device, backend: AttentionBackend, seq: int, kv_seq: int) -> None:
    facts = DeviceFacts.of(device, torch.bfloat16)
    try:
        select_attention_backend(backend.value, facts)
    except AttentionBackendUnavailableError as exc:
        pytest.skip(str(exc))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, seq, 8, 128, generator=g).to(device, torch.bfloat16)
    k = torch.randn(2, kv_seq, 8, 128, generator=g).to(device, torch.bfloat16)
    v = torch.randn(2, kv_seq, 8, 128, generator=g).to(device, torch.bfloat16)
    with torch.inference_mode():
        got = attention(q, k, v, backend=backend)
        want = attention(q, k, v, backend=AttentionBackend.SDPA)
    assert got.shape == want.shape and got.dtype == want.dtype
    similarity = cosine(got.float().cpu(), want.float().cpu())
    assert similarity >= MIN_COSINE.get(backend, DEFAULT_MIN_COSINE), (
        f"{backend.value}: cosine {similarity:.6f}"
    )


def test_auto_selection_on_this_device_is_logged_and_runs(device: torch.device, caplog) -> None:
    selection = select_attention_backend("auto", DeviceFacts.of(device, torch.bfloat16))
    q = torch.randn(1, 256, 4, 64, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = attention(q, q, q, backend=selection.backend)
    assert out.shape == q.shape and torch.isfinite(out).all()
    print(f"auto attention backend here: {selection.describe()}")
