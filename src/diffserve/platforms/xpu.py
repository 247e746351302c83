"""Intel XPU platform (`torch.xpu`, built into torch since 2.4)."""

from __future__ import annotations

import torch

from diffserve.platforms.base import TorchAcceleratorPlatform


class XpuPlatform(TorchAcceleratorPlatform):
    name = "xpu"
    device_type = "xpu"
    dispatch_key = "xpu"
    dist_backend = "xccl"
    runtime_module = "xpu"

    @classmethod
    def is_available(cls) -> bool:
        return hasattr(torch, "xpu") and torch.xpu.is_available()
