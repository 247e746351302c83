"""Apple Metal (MPS) platform."""

from __future__ import annotations

import torch

from diffserve.platforms.base import MemoryInfo, Platform
from diffserve.platforms.step_timer import EventMark, StepMark


class MpsPlatform(Platform):
    name = "mps"
    device_type = "mps"
    dispatch_key = "mps"

    @classmethod
    def is_available(cls) -> bool:
        return torch.backends.mps.is_available()

    @property
    def default_dtype(self) -> torch.dtype:
        # fp16 is the fast MPS path; bf16 support depends on the macOS version.
        return torch.float16

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("mps")

    def memory_info(self, index: int | None = None) -> MemoryInfo:
        allocated = torch.mps.driver_allocated_memory()
        recommended = torch.mps.recommended_max_memory()
        return MemoryInfo(allocated, max(recommended - allocated, 0), recommended)

    def synchronize(self, index: int | None = None) -> None:
        torch.mps.synchronize()

    def step_mark(self) -> StepMark:
        """A Metal timing event (`torch.mps.Event`): no host sync."""
        return EventMark(torch.mps)
