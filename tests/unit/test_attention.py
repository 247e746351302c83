"""The attention entry point: SDPA against a hand-written reference, backend resolution, and the scope
that makes a resolved backend active."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import sys

import pytest
import torch

import diffserve.layers.attention as attention_mod
from diffserve.layers.attention import (
    AttentionBackend,
    active_attention_backend,
    attention,
    attention_backend_scope,
    resolve_attention_backend,
)
from diffserve.layers.attention_backends import AttentionBackendUnavailableError, DeviceFacts

LOGGER = "diffserve.layers.attention"
OPTIONAL_PACKAGES = ("flash_attn", "flash_attn_interface", "sageattention")


@pytest.fixture(autouse=True)
def _fresh_log_once_set(monkeypatch):
    """The per-call fallback warnings are logged once per process; give each test an empty record."""
    monkeypatch.setattr(attention_mod, "_reported", set())


def fake_installed(monkeypatch, installed: bool) -> None:
    """Pretend flash_attn/sageattention are (not) importable, whatever this venv really has."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in OPTIONAL_PACKAGES:
            return object() if installed else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for name in OPTIONAL_PACKAGES:  # an imported module counts as installed: hide real ones
        monkeypatch.delitem(sys.modules, name, raising=False)


def reference_attention(q, k, v, mask=None):
    """softmax(Q K^T / sqrt(d) + mask) V, written out by hand in (batch, seq, heads, dim) layout."""
    d = q.shape[-1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))  # True = attend
    elif mask is not None:
        scores = scores + mask  # additive bias
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def qkv(batch=2, q_len=7, kv_len=7, heads=3, dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, q_len, heads, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_len, heads, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_len, heads, dim, generator=g, dtype=dtype)
    return q, k, v


# --- SDPA numerics -----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_len", [7, 11], ids=["self", "cross"])
def test_sdpa_matches_reference_without_mask(kv_len):
    q, k, v = qkv(kv_len=kv_len)
    out = attention(q, k, v, backend=AttentionBackend.SDPA)
    assert out.shape == q.shape  # (batch, seq, heads, dim) in, same layout out
    torch.testing.assert_close(out, reference_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_default_backend_is_sdpa_and_matches_reference():
    q, k, v = qkv()
    assert active_attention_backend() is AttentionBackend.SDPA
    torch.testing.assert_close(attention(q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_sdpa_matches_reference_with_boolean_mask():
    q, k, v = qkv(kv_len=9)
    # Key padding: batch 0 sees all 9 keys, batch 1 only the first 5. Mask is (batch, 1, q_len, kv_len).
    keep = torch.ones(2, 1, 7, 9, dtype=torch.bool)
    keep[1, ..., 5:] = False
    out = attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(out, reference_attention(q, k, v, keep), rtol=1e-5, atol=1e-5)
    # The masked keys really are ignored: changing them does not change batch 1's output.
    v2 = v.clone()
    v2[1, 5:] = 100.0
    torch.testing.assert_close(attention(q, k, v2, attn_mask=keep)[1], out[1])


def test_sdpa_matches_reference_with_additive_float_mask():
    q, k, v = qkv()
    bias = torch.randn(1, 3, 7, 7, generator=torch.Generator().manual_seed(1))  # per-head bias
    out = attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(out, reference_attention(q, k, v, bias), rtol=1e-5, atol=1e-5)


def test_sdpa_in_float64_is_tight():
    q, k, v = qkv(dtype=torch.float64)
    torch.testing.assert_close(attention(q, k, v), reference_attention(q, k, v), rtol=1e-12, atol=1e-12)


# --- backend resolution (the selector itself: tests/unit/test_attention_backends.py) ---------------


@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_3", "sage_attn"])
def test_named_backend_not_installed_is_a_clear_error(monkeypatch, name):
    fake_installed(monkeypatch, installed=False)
    with pytest.raises(AttentionBackendUnavailableError, match=rf"{name}.*not installed"):
        resolve_attention_backend(name, "cuda")


@pytest.mark.parametrize("name", ["flash_attn", "sage_attn", "sdpa_cudnn", "sdpa_efficient"])
def test_named_backend_on_cpu_is_a_clear_error_even_when_installed(monkeypatch, name):
    fake_installed(monkeypatch, installed=True)
    with pytest.raises(AttentionBackendUnavailableError, match=rf"{name} cannot run on a 'cpu' device"):
        resolve_attention_backend(name, "cpu")


def test_flash_attn_on_the_real_environment_cpu_is_refused():
    # Whatever is installed here, a CPU device never gets flash_attn.
    with pytest.raises(ValueError, match="flash_attn"):
        resolve_attention_backend("flash_attn", "cpu")


def test_installed_backend_on_an_ampere_gpu_is_selected_and_logged(monkeypatch, caplog):
    fake_installed(monkeypatch, installed=True)
    caplog.set_level(logging.INFO, logger=LOGGER)
    facts = DeviceFacts("cuda", capability=(8, 0), dtype=torch.bfloat16)
    assert resolve_attention_backend("flash_attn", "cuda", facts=facts) is AttentionBackend.FLASH_ATTN
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("flash_attn" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


@pytest.mark.parametrize("name", [None, "auto", "sdpa"])
def test_sdpa_auto_and_default_select_sdpa_on_cpu(caplog, name):
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert resolve_attention_backend(name, "cpu") is AttentionBackend.SDPA
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_none_uses_the_platform_default(monkeypatch):
    fake_installed(monkeypatch, installed=True)
    facts = DeviceFacts("cuda", capability=(9, 0), dtype=torch.bfloat16)
    chosen = resolve_attention_backend(None, "cuda", default="sage_attn", facts=facts)
    assert chosen is AttentionBackend.SAGE_ATTN


@pytest.mark.parametrize("name", ["flash", "xformers", "bogus"])
def test_unknown_backend_name_raises_value_error(name):
    with pytest.raises(ValueError, match=name):
        resolve_attention_backend(name, "cpu")


def test_resolving_changes_nothing_that_attention_reads(monkeypatch):
    """Resolution is pure: the active backend only changes inside a scope."""
    fake_installed(monkeypatch, installed=True)
    facts = DeviceFacts("cuda", capability=(9, 0), dtype=torch.bfloat16)
    assert resolve_attention_backend("flash_attn", "cuda", facts=facts) is AttentionBackend.FLASH_ATTN
    assert active_attention_backend() is AttentionBackend.SDPA


# --- the scope ----------------------------------------------------------------------------------


def test_scope_activates_the_backend_and_restores_the_enclosing_one():
    assert active_attention_backend() is AttentionBackend.SDPA
    with attention_backend_scope("flash_attn") as chosen:
        assert chosen is AttentionBackend.FLASH_ATTN
        assert active_attention_backend() is AttentionBackend.FLASH_ATTN
        with attention_backend_scope(AttentionBackend.SAGE_ATTN):
            assert active_attention_backend() is AttentionBackend.SAGE_ATTN
        assert active_attention_backend() is AttentionBackend.FLASH_ATTN
    assert active_attention_backend() is AttentionBackend.SDPA


def test_scope_is_left_on_error():
    with pytest.raises(RuntimeError), attention_backend_scope("sage_attn"):
        raise RuntimeError("model failed")
    assert active_attention_backend() is AttentionBackend.SDPA


def test_scope_rejects_unknown_backend():
    with pytest.raises(ValueError), attention_backend_scope("bogus"):
        pass
    assert active_attention_backend() is AttentionBackend.SDPA


def test_attention_dispatches_to_the_scope_backend(monkeypatch):
    """Inside a scope `attention()` runs that backend (faked here: flash_attn needs CUDA)."""
    spec = attention_mod.SPECS[AttentionBackend.FLASH_ATTN]
    fake = dataclasses.replace(spec, run=lambda q, k, v, mask: torch.full_like(q, 7.0))
    monkeypatch.setitem(attention_mod.SPECS, AttentionBackend.FLASH_ATTN, fake)
    q, k, v = qkv(dtype=torch.bfloat16)
    with attention_backend_scope("flash_attn"):
        assert torch.equal(attention(q, k, v), torch.full_like(q, 7.0))
    # Outside the scope, and with an explicit per-call backend, it is SDPA again.
    torch.testing.assert_close(attention(q, k, v).float(), reference_attention(q.float(), k.float(), v.float()),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
    with attention_backend_scope("flash_attn"):
        assert not torch.equal(attention(q, k, v, backend="sdpa"), torch.full_like(q, 7.0))


# --- per-call fallbacks of a selected fast backend ---------------------------------------------------


@pytest.mark.parametrize("backend", [AttentionBackend.FLASH_ATTN, AttentionBackend.SAGE_ATTN])
def test_fast_backend_with_fp32_inputs_runs_sdpa_and_logs_once(caplog, backend):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    q, k, v = qkv()
    for _ in range(3):
        out = attention(q, k, v, backend=backend)
        torch.testing.assert_close(out, reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert backend.value in messages[0] and "fp16/bf16" in messages[0]


@pytest.mark.parametrize("backend", [AttentionBackend.FLASH_ATTN, AttentionBackend.SAGE_ATTN])
def test_fast_backend_with_mask_runs_sdpa_and_logs_once(caplog, backend):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    q, k, v = qkv(dtype=torch.bfloat16)
    keep = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    keep[0, ..., 3:] = False
    for _ in range(2):
        out = attention(q, k, v, attn_mask=keep, backend=backend)
    expected = reference_attention(q.float(), k.float(), v.float(), keep)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "mask" in messages[0]
