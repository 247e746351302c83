"""Moore Threads MUSA platform, through the `torch_musa` extension (registers `torch.musa`)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from diffserve.platforms.base import TorchAcceleratorPlatform

logger = logging.getLogger(__name__)


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
        try:
            import torch_musa  # noqa: F401  (registers torch.musa)
        except Exception as exc:  # a broken vendor install must not stop detection elsewhere
            logger.warning("torch_musa is installed but failed to import (%s); musa is unavailable", exc)
            return False

        return hasattr(torch, "musa") and torch.musa.is_available()
