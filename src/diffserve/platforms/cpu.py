"""CPU platform: always available, the last entry of the detection order."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import psutil
import torch

from diffserve.platforms.base import MemoryInfo, Platform
from diffserve.platforms.step_timer import HostMark, StepMark

logger = logging.getLogger("diffserve.platform")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 2**20  # smaller allocations come from the (reused) heap, not fresh mmaps
TRIM_THRESHOLD_BYTES = 4 * 2**30  # freed heap memory kept, not given back to the OS, up to this


def _tune_glibc_malloc() -> bool:
    """Keep big activation buffers in glibc's heap instead of fresh mmaps that every step page-faults back
    in (`--tune-allocator`); returns whether glibc accepted the settings."""
    if not sys.platform.startswith("linux") or (name := ctypes.util.find_library("c")) is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _process_peak_rss_bytes() -> int | None:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB, macOS in bytes)."""
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

    def memory_info(self, index: int = 0) -> MemoryInfo:
        vm = psutil.virtual_memory()
        if (peak := _process_peak_rss_bytes()) is None:
            peak = psutil.Process().memory_info().rss
        return MemoryInfo(peak_bytes=peak, available_bytes=vm.available, total_bytes=vm.total)

    def device_name(self, index: int = 0) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"
