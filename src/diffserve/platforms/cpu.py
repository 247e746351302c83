"""CPU platform: always available, the last entry of the detection order."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from pathlib import Path

import psutil
import torch

from diffserve.platforms.base import MemoryInfo, Platform
from diffserve.platforms.step_timer import HostMark, StepMark

logger = logging.getLogger("diffserve.platform")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 2**20  # smaller allocations come from the (reused) heap, not fresh mmaps
TRIM_THRESHOLD_BYTES = 4 * 2**30  # freed heap memory kept, not given back to the OS, up to this

PROC_STATUS = Path("/proc/self/status")
#: Writing "5" here resets this process's VmHWM (peak RSS) to its current RSS (Linux >= 4.0, proc(5)).
CLEAR_REFS = Path("/proc/self/clear_refs")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, where this is Linux with glibc (its `mallopt` / `malloc_trim`); None elsewhere."""
    if not sys.platform.startswith("linux") or (name := ctypes.util.find_library("c")) is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _tune_glibc_malloc() -> bool:
    """Keep big activation buffers in glibc's heap instead of fresh mmaps that every step page-faults back
    in (`--tune-allocator`); returns whether glibc accepted the settings."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)  # not glibc (musl has no mallopt)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _trim_glibc_heap() -> bool:
    """Give glibc's free heap pages back to the OS (`malloc_trim(0)`), so RSS counts only live memory."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)  # its result says only whether pages were released
    return True


def _status_kib(*keys: str) -> dict[str, int] | None:
    """Fields of /proc/self/status (values in KiB) read in one go; None off Linux or when a key is missing."""
    try:
        lines = PROC_STATUS.read_text().splitlines()
    except OSError:
        return None
    values = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if k in keys}
    return values if len(values) == len(keys) else None


def read_vm_hwm_bytes() -> int | None:
    """This process's peak resident set size since it started or since `reset_vm_hwm` (VmHWM); None
    where /proc/self/status has no VmHWM (not Linux)."""
    status = _status_kib("VmHWM")
    return None if status is None else status["VmHWM"] * 1024


def reset_vm_hwm() -> bool:
    """Restart the VmHWM peak at the current RSS; False where the kernel does not allow it."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@functools.cache
def vm_hwm_resets() -> bool:
    """Whether VmHWM can be read and reset here: after a reset it equals the RSS of the same reading (it
    can only have grown with it). Checked once per process; the answer is logged."""
    works = reset_vm_hwm() and (status := _status_kib("VmHWM", "VmRSS")) is not None
    works = works and status["VmHWM"] <= status["VmRSS"]
    if works:
        logger.info("CPU peak memory: VmHWM, reset through %s", CLEAR_REFS)
    else:
        logger.warning(
            "CPU peak memory: cannot reset VmHWM through %s (not Linux, or a kernel without it); the memory "
            "model stays estimated and the peak reported is the process's lifetime peak RSS",
            CLEAR_REFS,
        )
    return works


def _process_peak_rss_bytes() -> int | None:
    """Peak resident set size of this process over its lifetime (Linux reports ru_maxrss in KiB, macOS in
    bytes); None on Windows."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dispatch_key = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def default_dtype(self) -> torch.dtype:
        # bf16 matmuls are much slower than fp32 on CPUs without AMX.
        return torch.float32

    def prepare_process(self) -> None:
        if _tune_glibc_malloc():
            logger.info(
                "CPU allocator: glibc mmap threshold %d MiB, trim threshold %d GiB (activations stay "
                "mapped between steps)",
                MMAP_THRESHOLD_BYTES >> 20,
                TRIM_THRESHOLD_BYTES >> 30,
            )
        else:
            logger.info("CPU allocator: default (not glibc; activations may be re-mapped every step)")

    def step_mark(self) -> StepMark:
        """The host clock: CPU ops have finished when they return, so there is nothing to wait for."""
        return HostMark()

    def memory_info(self, index: int | None = None) -> MemoryInfo:
        """Peak RSS since the last `reset_peak_memory` (VmHWM) where it resets, else the lifetime peak."""
        vm = psutil.virtual_memory()
        peak = read_vm_hwm_bytes() if vm_hwm_resets() else None
        if peak is None and (peak := _process_peak_rss_bytes()) is None:
            peak = psutil.Process().memory_info().rss
        return MemoryInfo(peak_bytes=peak, available_bytes=vm.available, total_bytes=vm.total)

    def has_peak_counter(self) -> bool:
        return vm_hwm_resets()

    def reset_peak_memory(self, index: int | None = None) -> None:
        if vm_hwm_resets():
            reset_vm_hwm()

    def empty_cache(self) -> None:
        """Hand glibc's free heap pages back, so the RSS (and free memory) measured next counts only live
        memory: a peak measured from an RSS that still holds freed pages would miss what reuses them."""
        _trim_glibc_heap()

    def device_name(self, index: int | None = None) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"
