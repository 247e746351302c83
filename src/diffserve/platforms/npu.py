"""Huawei Ascend NPU platform, through the `torch_npu` extension (registers `torch.npu`)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from diffserve.platforms.base import TorchAcceleratorPlatform

logger = logging.getLogger(__name__)


class NpuPlatform(TorchAcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    dispatch_key = "npu"
    dist_backend = "hccl"
    default_attention_backend = "sdpa"
    runtime_module = "npu"

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except Exception as exc:  # a broken vendor install must not stop detection elsewhere
            logger.warning("torch_npu is installed but failed to import (%s); npu is unavailable", exc)
            return False

        return hasattr(torch, "npu") and torch.npu.is_available()
