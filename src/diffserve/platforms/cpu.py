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

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap and are reused instead of being mmap'ed and unmapped
#: each time: a DiT step allocates and frees the same activation sizes (up to tens of MB) every step.
MMAP_THRESHOLD_BYTES = 32 * 2**20
#: Freed heap memory is kept (not trimmed back to the OS) up to this much.
TRIM_THRESHOLD_BYTES = 4 * 2**30


def _tune_glibc_malloc() -> bool:
    """Stop glibc from returning big activation buffers to the OS after every use.

    By default glibc serves allocations over 128 KiB-32 MiB (adaptive) with fresh mmaps and unmaps them
    on free, so every denoising step page-faults its activations back in: measured at ~5% of a FLUX
    step's CPU time on one 2-core host (AMD EPYC). Raising both thresholds keeps those pages in the heap.
    On another 2-core host (Intel Xeon, 2026-12-01) the same setting made eager FLUX steps 4.5% slower
    and less steady (0.173 vs 0.1655 s/step, 5 processes each, alternating), so it is opt-in
    (`--tune-allocator`). Numerically neutral; returns whether glibc accepted the settings.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
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
    dist_backend = "gloo"
    default_attention_backend = "sdpa"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def default_dtype(self) -> torch.dtype:
        # bf16 matmuls run ~5x slower than fp32 on CPUs without AMX, so fp32 is the CPU default.
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
        peak = _process_peak_rss_bytes()
        if peak is None:
            peak = psutil.Process().memory_info().rss
        return MemoryInfo(peak_bytes=peak, available_bytes=vm.available, total_bytes=vm.total)

    def device_name(self, index: int = 0) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"
