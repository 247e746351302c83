"""The attention backend selector (`layers/attention_backends.py`) and the kernels' call adapters.

The kernels themselves need a GPU (tests/gpu/test_attention_backends_gpu.py compares each against SDPA
there). Here: with none of them installed, `auto` picks SDPA and logs why each faster one was passed
over, and naming one is a clear error; with fake kernel modules placed in `sys.modules`, the selection
follows the device, dtype and package rules, and each adapter hands the kernel the (batch, seq, heads,
head_dim) layout it documents: a fake kernel that computes SDPA in that layout gives SDPA's output
through the adapter, bit for bit."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import diffserve.layers.attention as attention_mod
from diffserve.layers.attention import attention, resolve_attention_backend
from diffserve.layers.attention_backends import (
    AUTO_ORDER,
    AttentionBackend,
    AttentionBackendUnavailableError,
    DeviceFacts,
    select_attention_backend,
)

LOGGER = "diffserve.layers.attention"
PACKAGES = {
    AttentionBackend.FLASH_ATTN_3: "flash_attn_interface",
    AttentionBackend.FLASH_ATTN: "flash_attn",
    AttentionBackend.SAGE_ATTN: "sageattention",
}
HOPPER = DeviceFacts("cuda", capability=(9, 0), dtype=torch.bfloat16)
AMPERE = DeviceFacts("cuda", capability=(8, 0), dtype=torch.bfloat16)
CPU = DeviceFacts("cpu", dtype=torch.float32)


@pytest.fixture(autouse=True)
def _no_real_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this venv has, the kernels' packages count as absent unless a test injects a fake."""
    for package in PACKAGES.values():
        monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.setattr(attention_mod, "_reported", set())


def sdpa_in_nhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over (batch, seq, heads, head_dim) tensors, as the real kernels take them."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
        1, 2
    )


class FakeKernels:
    """Fake kernel packages: each computes SDPA on the layout it documents and records its calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple[int, ...], dict]] = []
        self.monkeypatch = monkeypatch

    def install(self, backend: AttentionBackend) -> None:
        package = PACKAGES[backend]
        module = types.ModuleType(package)
        if backend is AttentionBackend.SAGE_ATTN:

            def sageattn(q, k, v, tensor_layout="HND", is_causal=False, **kwargs):  # noqa: ANN001, ANN202
                self.calls.append(
                    (package, tuple(q.shape), {"tensor_layout": tensor_layout, "causal": is_causal})
                )
                assert tensor_layout == "NHD" and not is_causal
                return sdpa_in_nhd(q, k, v)

            module.sageattn = sageattn
        else:
            returns_lse = backend is AttentionBackend.FLASH_ATTN_3  # FA3 releases return (out, lse)

            def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):  # noqa: ANN001, ANN202
                self.calls.append((package, tuple(q.shape), {"causal": causal, "dropout_p": dropout_p}))
                assert not causal and dropout_p == 0.0 and softmax_scale is None
                out = sdpa_in_nhd(q, k, v)
                return (out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])) if returns_lse else out

            module.flash_attn_func = flash_attn_func
        self.monkeypatch.setitem(sys.modules, package, module)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKernels]:
    yield FakeKernels(monkeypatch)


def qkv(batch: int = 2, seq: int = 24, kv_seq: int | None = None, heads: int = 3, dim: int = 64,
        dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(0)
    kv_seq = seq if kv_seq is None else kv_seq
    q = torch.randn(batch, seq, heads, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_seq, heads, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_seq, heads, dim, generator=g).to(dtype)
    return q, k, v


# -- with every kernel absent --------------------------------------------------------------------------


@pytest.mark.parametrize("facts", [CPU, HOPPER, AMPERE], ids=["cpu", "hopper", "ampere"])
def test_auto_without_kernels_picks_sdpa_and_logs_why(facts: DeviceFacts, caplog, monkeypatch) -> None:
    monkeypatch.setattr("diffserve.layers.attention_backends._cudnn_attention_available", lambda: False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert resolve_attention_backend("auto", facts.device_type, facts=facts) is AttentionBackend.SDPA
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert line.startswith("Attention backend: sdpa (auto); not chosen: ")
    for backend in AttentionBackend:
        if backend is not AttentionBackend.SDPA:
            assert f"{backend.value}: " in line, backend
    assert "'flash_attn_interface' package is not installed" in line
    assert "'flash_attn' package is not installed" in line
    assert "sage_attn: approximate" in line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("name", ["flash_attn_3", "flash_attn", "sage_attn"])
def test_naming_an_absent_kernel_is_a_clear_error(name: str) -> None:
    with pytest.raises(AttentionBackendUnavailableError) as info:
        select_attention_backend(name, HOPPER)
    message = str(info.value)
    assert f"--attention-backend {name} cannot run on an NVIDIA device of compute capability 9.0" in message
    assert f"'{PACKAGES[AttentionBackend(name)]}' package is not installed" in message
    assert "omit the flag" in message


@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_efficient"])
def test_naming_a_torch_kernel_on_the_cpu_is_a_clear_error(name: str) -> None:
    with pytest.raises(
        AttentionBackendUnavailableError, match=rf"{name} cannot run on a 'cpu' device: needs"
    ):
        select_attention_backend(name, CPU)


def test_cudnn_needs_cudnn_9(monkeypatch) -> None:
    monkeypatch.setattr("diffserve.layers.attention_backends._cudnn_attention_available", lambda: False)
    with pytest.raises(AttentionBackendUnavailableError, match="cuDNN 9"):
        select_attention_backend("sdpa_cudnn", HOPPER)
    monkeypatch.setattr("diffserve.layers.attention_backends._cudnn_attention_available", lambda: True)
    assert select_attention_backend("sdpa_cudnn", HOPPER).backend is AttentionBackend.SDPA_CUDNN
    assert select_attention_backend("auto", HOPPER).backend is AttentionBackend.SDPA_CUDNN


# -- selection with fake kernels -----------------------------------------------------------------------


def test_auto_prefers_flash_attention_3_on_hopper(kernels: FakeKernels) -> None:
    for backend in PACKAGES:
        kernels.install(backend)
    selection = select_attention_backend("auto", HOPPER)
    assert selection.backend is AttentionBackend.FLASH_ATTN_3
    reasons = dict(selection.not_chosen)
    assert reasons[AttentionBackend.FLASH_ATTN] == "flash_attn_3 comes first"
    assert "approximate" in reasons[AttentionBackend.SAGE_ATTN]


def test_auto_takes_flash_attention_2_where_3_cannot_run(kernels: FakeKernels) -> None:
    for backend in PACKAGES:
        kernels.install(backend)
    selection = select_attention_backend("auto", AMPERE)
    assert selection.backend is AttentionBackend.FLASH_ATTN
    assert (
        "needs compute capability 9.x (Hopper)" in dict(selection.not_chosen)[AttentionBackend.FLASH_ATTN_3]
    )


def test_auto_never_picks_sage_attention(kernels: FakeKernels, monkeypatch) -> None:
    monkeypatch.setattr("diffserve.layers.attention_backends._cudnn_attention_available", lambda: False)
    kernels.install(AttentionBackend.SAGE_ATTN)
    assert select_attention_backend("auto", HOPPER).backend is AttentionBackend.SDPA
    assert select_attention_backend("sage_attn", HOPPER).backend is AttentionBackend.SAGE_ATTN


def test_fp32_models_and_old_gpus_do_not_get_the_fast_kernels(kernels: FakeKernels) -> None:
    for backend in PACKAGES:
        kernels.install(backend)
    fp32 = DeviceFacts("cuda", capability=(9, 0), dtype=torch.float32)
    with pytest.raises(AttentionBackendUnavailableError, match="fp16/bf16.*--dtype bfloat16"):
        select_attention_backend("flash_attn", fp32)
    turing = DeviceFacts("cuda", capability=(7, 5), dtype=torch.float16)
    with pytest.raises(AttentionBackendUnavailableError, match=r"compute capability >= 8\.0"):
        select_attention_backend("flash_attn", turing)
    assert select_attention_backend("auto", turing).backend is AttentionBackend.SDPA


def test_rocm_gets_flash_attention_2_but_not_the_nvidia_only_kernels(kernels: FakeKernels) -> None:
    for backend in PACKAGES:
        kernels.install(backend)
    rocm = DeviceFacts("cuda", is_hip=True, dtype=torch.bfloat16)
    assert select_attention_backend("auto", rocm).backend is AttentionBackend.FLASH_ATTN
    for name in ("flash_attn_3", "sage_attn", "sdpa_cudnn"):
        with pytest.raises(AttentionBackendUnavailableError, match="ROCm"):
            select_attention_backend(name, rocm)
    assert select_attention_backend("sdpa_efficient", rocm).backend is AttentionBackend.SDPA_EFFICIENT


def test_auto_order_ends_with_sdpa() -> None:
    assert AUTO_ORDER[-1] is AttentionBackend.SDPA


# -- the call adapters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(PACKAGES), ids=lambda b: b.value)
@pytest.mark.parametrize("kv_seq", [24, 40], ids=["self", "cross"])
def test_adapter_layout_gives_sdpa_bit_for_bit(
    kernels: FakeKernels, backend: AttentionBackend, kv_seq: int
) -> None:
    kernels.install(backend)
    q, k, v = qkv(kv_seq=kv_seq)
    out = attention(q, k, v, backend=backend)
    assert [c[1] for c in kernels.calls] == [tuple(q.shape)]  # the kernel ran, on (batch, seq, heads, dim)
    assert out.shape == q.shape
    assert torch.equal(out, attention(q, k, v, backend="sdpa"))


@pytest.mark.parametrize("backend", list(PACKAGES), ids=lambda b: b.value)
def test_adapter_calls_the_kernel_non_causal(kernels: FakeKernels, backend: AttentionBackend) -> None:
    kernels.install(backend)
    attention(*qkv(), backend=backend)
    assert kernels.calls[0][2]["causal"] is False


@pytest.mark.parametrize(
    ("backend", "kwargs", "reason"),
    [
        (AttentionBackend.FLASH_ATTN, {"dim": 264}, "head dim"),
        (AttentionBackend.FLASH_ATTN_3, {"dim": 20}, "head dim"),
        (AttentionBackend.SAGE_ATTN, {"dim": 32}, "head dim of 64, 96 or 128"),
        (AttentionBackend.FLASH_ATTN, {"dtype": torch.float32}, "fp16/bf16"),
    ],
)
def test_calls_a_kernel_cannot_take_run_on_sdpa_logged_once(kernels, caplog, backend, kwargs, reason) -> None:
    kernels.install(backend)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    q, k, v = qkv(**kwargs)
    for _ in range(2):
        out = attention(q, k, v, backend=backend)
    assert not kernels.calls
    assert torch.equal(out, attention(q, k, v, backend="sdpa"))
    [message] = [r.getMessage() for r in caplog.records]
    assert backend.value in message and reason in message and "SDPA" in message


def test_masked_calls_run_on_sdpa(kernels: FakeKernels) -> None:
    kernels.install(AttentionBackend.FLASH_ATTN)
    q, k, v = qkv()
    keep = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    keep[1, ..., 20:] = False
    out = attention(q, k, v, attn_mask=keep, backend=AttentionBackend.FLASH_ATTN)
    assert not kernels.calls
    assert torch.equal(out, attention(q, k, v, attn_mask=keep, backend="sdpa"))


def test_pinned_sdpa_adapters_keep_the_layout(monkeypatch) -> None:
    """cuDNN and efficient SDPA are SDPA with one kernel allowed: the adapter transposes like SDPA's
    (checked here with the CPU's MATH kernel standing in, as neither pinned kernel runs on the CPU)."""
    math = torch.nn.attention.SDPBackend.MATH
    monkeypatch.setattr("torch.nn.attention.SDPBackend.CUDNN_ATTENTION", math)
    monkeypatch.setattr("torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION", math)
    q, k, v = qkv()  # bf16, head dim 64: calls both kernels take
    expected = sdpa_in_nhd(q.float(), k.float(), v.float())
    for backend in (AttentionBackend.SDPA_CUDNN, AttentionBackend.SDPA_EFFICIENT):
        out = attention(q, k, v, backend=backend)
        assert out.shape == q.shape
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert not attention_mod._reported  # neither call fell back to plain SDPA


def test_a_pinned_sdpa_kernel_that_refuses_the_inputs_falls_back_logged(caplog) -> None:
    """On the CPU neither pinned kernel exists: torch refuses, and the call runs on SDPA, logged once."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    q, k, v = qkv()
    for _ in range(2):
        out = attention(q, k, v, backend=AttentionBackend.SDPA_EFFICIENT)
    assert torch.equal(out, attention(q, k, v, backend="sdpa"))
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("sdpa_efficient refused these inputs (") and "using SDPA" in message
