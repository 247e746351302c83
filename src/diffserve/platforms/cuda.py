"""NVIDIA CUDA platform (a `torch.cuda` build that is not HIP)."""

from __future__ import annotations

import torch

from diffserve.platforms.base import TorchAcceleratorPlatform


class CudaPlatform(TorchAcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    dispatch_key = "cuda"
    dist_backend = "nccl"
    runtime_module = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is None and torch.cuda.is_available()
