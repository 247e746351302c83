"""CPU platform: always available, the last entry of the detection order."""

from __future__ import annotations

import psutil
import torch

from diffserve.platforms.base import MemoryInfo, Platform


def _process_peak_rss_bytes() -> int | None:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    try:
        import resource
        import sys
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

    def memory_info(self, index: int = 0) -> MemoryInfo:
        vm = psutil.virtual_memory()
        peak = _process_peak_rss_bytes()
        if peak is None:
            peak = psutil.Process().memory_info().rss
        return MemoryInfo(peak_bytes=peak, available_bytes=vm.available, total_bytes=vm.total)

    def device_name(self, index: int = 0) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"
