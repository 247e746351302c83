"""AMD ROCm platform: torch built with HIP exposes its devices as `cuda`, with `torch.version.hip` set."""

from __future__ import annotations

import torch

from diffserve.platforms.base import TorchAcceleratorPlatform


class RocmPlatform(TorchAcceleratorPlatform):
    name = "rocm"
    device_type = "cuda"  # HIP builds of torch reuse the "cuda" device type.
    dispatch_key = "hip"
    dist_backend = "nccl"  # RCCL answers to the "nccl" backend name in torch.distributed.
    runtime_module = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is not None and torch.cuda.is_available()
