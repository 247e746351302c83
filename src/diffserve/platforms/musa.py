"""Moore Threads MUSA platform, through the `torch_musa` extension (registers `torch.musa`)."""

from __future__ import annotations

from diffserve.platforms.base import TorchAcceleratorPlatform


class MusaPlatform(TorchAcceleratorPlatform):
    name = "musa"
    device_type = "musa"
    dispatch_key = "musa"
    dist_backend = "mccl"
    runtime_module = "musa"

    @classmethod
    def is_available(cls) -> bool:
        return cls._extension_available("torch_musa")
