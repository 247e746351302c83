"""Moore Threads MUSA platform, through the `torch_musa` extension (registers `torch.musa`)."""

from __future__ import annotations

import importlib.util

import torch

from diffserve.platforms.base import TorchAcceleratorPlatform


class MusaPlatform(TorchAcceleratorPlatform):
    name = "musa"
    device_type = "musa"
    dispatch_key = "musa"
    dist_backend = "mccl"
    default_attention_backend = "sdpa"
    runtime_module = "musa"

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_musa") is None:
            return False
        import torch_musa  # noqa: F401  (registers torch.musa)

        return hasattr(torch, "musa") and torch.musa.is_available()
