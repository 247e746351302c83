"""Platform detection order, `--device` override, per-platform attributes and memory queries.

No accelerator is needed: each platform's availability is faked by patching its `is_available`
classmethod, and the accelerator memory API is exercised against a fake `torch.<runtime>` module.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from diffserve.platforms import (
    DETECTION_ORDER,
    PLATFORMS_BY_NAME,
    CpuPlatform,
    CudaPlatform,
    MemoryInfo,
    MpsPlatform,
    MusaPlatform,
    NpuPlatform,
    Platform,
    PlatformUnavailableError,
    RocmPlatform,
    XpuPlatform,
    detect_platform,
    platform_by_name,
    resolve_platform,
)
from diffserve.platforms.base import TorchAcceleratorPlatform

DOCUMENTED_ORDER = ("cuda", "rocm", "musa", "xpu", "npu", "mps", "cpu")

# name -> (class, torch device type, CustomOp dispatch key, torch.distributed backend, default dtype)
DOCUMENTED_ATTRIBUTES = {
    "cuda": (CudaPlatform, "cuda", "cuda", "nccl", torch.bfloat16),
    "rocm": (RocmPlatform, "cuda", "hip", "nccl", torch.bfloat16),
    "musa": (MusaPlatform, "musa", "musa", "mccl", torch.bfloat16),
    "xpu": (XpuPlatform, "xpu", "xpu", "xccl", torch.bfloat16),
    "npu": (NpuPlatform, "npu", "npu", "hccl", torch.bfloat16),
    "mps": (MpsPlatform, "mps", "mps", "gloo", torch.float16),
    "cpu": (CpuPlatform, "cpu", "cpu", "gloo", torch.float32),
}


def fake_availability(monkeypatch, available: set[type[Platform]]) -> None:
    """Make exactly the classes in `available` report a device (CPU must be listed to be available)."""
    for cls in DETECTION_ORDER:
        flag = cls in available
        monkeypatch.setattr(cls, "is_available", classmethod(lambda c, flag=flag: flag))


# --- detection order -------------------------------------------------------------------------


def test_detection_order_is_the_documented_one():
    assert tuple(cls.name for cls in DETECTION_ORDER) == DOCUMENTED_ORDER
    assert tuple(PLATFORMS_BY_NAME) == DOCUMENTED_ORDER
    assert all(PLATFORMS_BY_NAME[name].name == name for name in DOCUMENTED_ORDER)


@pytest.mark.parametrize("position", range(len(DETECTION_ORDER)), ids=DOCUMENTED_ORDER)
def test_detection_picks_first_available_when_it_and_all_later_ones_are_available(monkeypatch, position):
    fake_availability(monkeypatch, set(DETECTION_ORDER[position:]))
    picked = detect_platform()
    assert type(picked) is DETECTION_ORDER[position]


@pytest.mark.parametrize("position", range(len(DETECTION_ORDER)), ids=DOCUMENTED_ORDER)
def test_detection_picks_the_only_accelerator_over_cpu(monkeypatch, position):
    fake_availability(monkeypatch, {DETECTION_ORDER[position], CpuPlatform})
    assert type(detect_platform()) is DETECTION_ORDER[position]


def test_detection_falls_back_to_cpu_when_nothing_else_is_available(monkeypatch):
    fake_availability(monkeypatch, {CpuPlatform})
    assert type(detect_platform()) is CpuPlatform


def test_detection_skips_unavailable_platforms_in_the_middle(monkeypatch):
    fake_availability(monkeypatch, {XpuPlatform, MpsPlatform, CpuPlatform})
    assert type(detect_platform()) is XpuPlatform


def test_cpu_is_always_available():
    assert CpuPlatform.is_available() is True


def test_resolve_platform_none_detects_and_remembers_nothing(monkeypatch):
    fake_availability(monkeypatch, {NpuPlatform, CpuPlatform})
    first = resolve_platform(None)
    assert type(first) is NpuPlatform
    # Each call is a fresh detection and a fresh instance: the caller keeps the one it was given.
    assert resolve_platform(None) is not first
    fake_availability(monkeypatch, {CpuPlatform})
    assert type(resolve_platform(None)) is CpuPlatform
    assert type(first) is NpuPlatform


# --- ROCm vs CUDA ----------------------------------------------------------------------------


def test_rocm_is_told_apart_from_cuda_by_torch_version_hip(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert RocmPlatform.is_available() is True
    assert CudaPlatform.is_available() is False
    picked = detect_platform()
    assert type(picked) is RocmPlatform
    assert picked.device_type == "cuda"  # HIP builds reuse the "cuda" device type...
    assert picked.dispatch_key == "hip"  # ...but ops dispatch to their HIP kernels.
    assert picked.device() == torch.device("cuda", 0)


def test_cuda_is_picked_when_torch_is_not_a_hip_build(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert CudaPlatform.is_available() is True
    assert RocmPlatform.is_available() is False
    assert type(detect_platform()) is CudaPlatform


def test_neither_cuda_nor_rocm_without_a_visible_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for hip in (None, "6.2.41133"):
        monkeypatch.setattr(torch.version, "hip", hip)
        assert CudaPlatform.is_available() is False
        assert RocmPlatform.is_available() is False


# --- explicit choice (--device / resolve_platform) ---------------------------------------------


def test_platform_by_name_unknown_name_lists_the_choices():
    with pytest.raises(PlatformUnavailableError) as excinfo:
        platform_by_name("tpu")
    message = str(excinfo.value)
    assert "'tpu'" in message
    for name in DOCUMENTED_ORDER:
        assert name in message


@pytest.mark.parametrize("name", [n for n in DOCUMENTED_ORDER if n != "cpu"])
def test_platform_by_name_unavailable_platform_is_an_error_not_a_cpu_fallback(monkeypatch, name):
    fake_availability(monkeypatch, {CpuPlatform})
    with pytest.raises(PlatformUnavailableError, match=f"'{name}'.*no device"):
        platform_by_name(name)


def test_platform_unavailable_error_is_a_runtime_error():
    assert issubclass(PlatformUnavailableError, RuntimeError)


@pytest.mark.parametrize("name", DOCUMENTED_ORDER)
def test_platform_by_name_returns_the_named_platform_when_available(monkeypatch, name):
    cls = PLATFORMS_BY_NAME[name]
    fake_availability(monkeypatch, {cls, CpuPlatform})
    assert type(platform_by_name(name)) is cls


def test_platform_by_name_ignores_case_and_index_zero(monkeypatch):
    fake_availability(monkeypatch, {CudaPlatform, CpuPlatform})
    assert type(platform_by_name("CUDA")) is CudaPlatform
    assert type(platform_by_name("cuda:0")) is CudaPlatform


def test_platform_by_name_refuses_other_device_indices(monkeypatch):
    """A silent run on device 0 when the user asked for device 1 would be wrong; refuse it clearly."""
    fake_availability(monkeypatch, {CudaPlatform, CpuPlatform})
    with pytest.raises(PlatformUnavailableError, match="CUDA_VISIBLE_DEVICES"):
        platform_by_name("cuda:1")


def test_cuda_name_maps_to_rocm_on_hip_builds(monkeypatch):
    fake_availability(monkeypatch, {RocmPlatform, CpuPlatform})
    assert type(platform_by_name("cuda")) is RocmPlatform


def test_resolve_platform_cpu():
    assert type(resolve_platform("cpu")) is CpuPlatform


def test_resolve_platform_name_overrides_detection(monkeypatch):
    fake_availability(monkeypatch, {CudaPlatform, CpuPlatform})
    assert type(resolve_platform("cpu")) is CpuPlatform
    assert type(resolve_platform(None)) is CudaPlatform


def test_resolve_platform_unavailable_is_an_error(monkeypatch):
    fake_availability(monkeypatch, {CpuPlatform})
    with pytest.raises(PlatformUnavailableError):
        resolve_platform("cuda")


# --- declared attributes -------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCUMENTED_ORDER)
def test_platform_declares_documented_attributes(name):
    cls, device_type, dispatch_key, dist_backend, dtype = DOCUMENTED_ATTRIBUTES[name]
    platform = cls()
    assert cls.name == name
    assert cls.device_type == device_type
    assert cls.dispatch_key == dispatch_key
    assert cls.dist_backend == dist_backend
    assert cls.default_attention_backend == "auto"
    assert platform.default_dtype == dtype
    assert isinstance(platform.default_dtype, torch.dtype)
    assert name in repr(platform) or device_type in repr(platform)


def test_cpu_defaults_to_float32():
    assert CpuPlatform().default_dtype == torch.float32


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (CpuPlatform, torch.device("cpu")),
        (CudaPlatform, torch.device("cuda", 0)),
        (RocmPlatform, torch.device("cuda", 0)),
        (XpuPlatform, torch.device("xpu", 0)),
        (MpsPlatform, torch.device("mps")),
    ],
)
def test_device(cls, expected):
    # musa/npu are left out: stock torch only knows those device types once torch_musa/torch_npu load.
    assert cls().device() == expected


def test_device_index():
    assert CudaPlatform().device(1) == torch.device("cuda", 1)
    assert CpuPlatform().device(3) == torch.device("cpu")


# --- memory ----------------------------------------------------------------------------------


def test_cpu_memory_info_reports_process_peak_and_available_bytes():
    rss_before = psutil.Process().memory_info().rss
    info = CpuPlatform().memory_info()
    assert isinstance(info, MemoryInfo)
    assert isinstance(info.peak_bytes, int) and info.peak_bytes > 0
    assert isinstance(info.available_bytes, int) and info.available_bytes > 0
    assert isinstance(info.total_bytes, int) and info.total_bytes >= info.available_bytes
    # The peak is the process's peak RSS, so it is at least the RSS we just saw (in bytes, not KiB).
    assert info.peak_bytes >= 0.9 * rss_before
    assert info.peak_bytes <= info.total_bytes


def test_cpu_reset_peak_and_synchronize_are_harmless():
    cpu = CpuPlatform()
    cpu.reset_peak_memory()
    cpu.synchronize()
    assert isinstance(cpu.device_name(), str) and cpu.device_name()


class FakeRuntime:
    """Stands in for `torch.cuda` / `torch.xpu` / ...: the subset of the memory API platforms use."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self.calls.append(("mem_get_info", index))
        return 3 * 2**30, 16 * 2**30

    def max_memory_allocated(self, index: int) -> int:
        self.calls.append(("max_memory_allocated", index))
        return 5 * 2**20

    def reset_peak_memory_stats(self, index: int) -> None:
        self.calls.append(("reset_peak_memory_stats", index))

    def synchronize(self, index: int) -> None:
        self.calls.append(("synchronize", index))

    def get_device_name(self, index: int) -> str:
        self.calls.append(("get_device_name", index))
        return "Fake Accelerator 9000"


ACCELERATOR_CLASSES = [CudaPlatform, RocmPlatform, MusaPlatform, XpuPlatform, NpuPlatform]


def test_accelerator_classes_share_the_torch_runtime_logic():
    expected = {"cuda": "cuda", "rocm": "cuda", "musa": "musa", "xpu": "xpu", "npu": "npu"}
    for cls in ACCELERATOR_CLASSES:
        assert issubclass(cls, TorchAcceleratorPlatform)
        assert cls.runtime_module == expected[cls.name]


@pytest.mark.parametrize("cls", ACCELERATOR_CLASSES, ids=lambda c: c.name)
def test_accelerator_memory_info_reads_the_torch_runtime(monkeypatch, cls):
    fake = FakeRuntime()
    # torch.musa / torch.npu only exist once their extension is imported, hence raising=False.
    monkeypatch.setattr(torch, cls.runtime_module, fake, raising=False)
    platform = cls()

    info = platform.memory_info(1)
    assert info == MemoryInfo(peak_bytes=5 * 2**20, available_bytes=3 * 2**30, total_bytes=16 * 2**30)
    assert ("mem_get_info", 1) in fake.calls
    assert ("max_memory_allocated", 1) in fake.calls

    platform.reset_peak_memory(1)
    platform.synchronize(1)
    assert platform.device_name(1) == "Fake Accelerator 9000"
    assert fake.calls[-3:] == [("reset_peak_memory_stats", 1), ("synchronize", 1), ("get_device_name", 1)]


def test_accelerator_memory_info_default_index_is_zero(monkeypatch):
    fake = FakeRuntime()
    monkeypatch.setattr(torch, "cuda", fake)
    CudaPlatform().memory_info()
    assert ("mem_get_info", 0) in fake.calls


def test_mps_memory_info_from_driver_counters(monkeypatch):
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 2 * 2**30)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 10 * 2**30)
    info = MpsPlatform().memory_info()
    assert info == MemoryInfo(peak_bytes=2 * 2**30, available_bytes=8 * 2**30, total_bytes=10 * 2**30)


def test_cpu_prepare_process_keeps_activations_mapped_on_glibc(caplog):
    import ctypes.util
    import logging
    import sys

    from diffserve.platforms.cpu import CpuPlatform

    with caplog.at_level(logging.INFO, logger="diffserve.platform"):
        CpuPlatform().prepare_process()
    glibc = sys.platform.startswith("linux") and ctypes.util.find_library("c") is not None
    expected = "glibc mmap threshold 32 MiB" if glibc else "CPU allocator: default"
    assert expected in caplog.text


def test_allocator_tuning_is_opt_in(tmp_path, monkeypatch):
    """An engine applies the platform's allocator tuning only with tune_allocator (`--tune-allocator`)."""
    from diffserve.api import DiffGenerator
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
    from diffserve.platforms.cpu import CpuPlatform

    calls = []
    monkeypatch.setattr(CpuPlatform, "prepare_process", lambda self: calls.append(self.name))
    path = build_tiny_flux(tmp_path / "flux", TinyFluxSpec(num_layers=1, num_single_layers=1))
    DiffGenerator.from_pretrained(path, device="cpu", show_progress=False)
    assert calls == []
    DiffGenerator.from_pretrained(path, device="cpu", show_progress=False, tune_allocator=True)
    assert calls == ["cpu"]
