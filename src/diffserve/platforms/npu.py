"""Huawei Ascend NPU platform, through the `torch_npu` extension (registers `torch.npu`)."""

from __future__ import annotations

from diffserve.platforms.base import TorchAcceleratorPlatform


class NpuPlatform(TorchAcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    dispatch_key = "npu"
    dist_backend = "hccl"
    runtime_module = "npu"

    @classmethod
    def is_available(cls) -> bool:
        return cls._extension_available("torch_npu")
