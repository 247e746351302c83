"""Platform detection: the first available of `DETECTION_ORDER` (docs/hardware.md), or the one
`--device NAME` names (never a silent fall back to the CPU); there is no process-wide current one."""

from __future__ import annotations

from diffserve.platforms.base import MemoryInfo, Platform
from diffserve.platforms.cpu import CpuPlatform
from diffserve.platforms.cuda import CudaPlatform
from diffserve.platforms.mps import MpsPlatform
from diffserve.platforms.musa import MusaPlatform
from diffserve.platforms.npu import NpuPlatform
from diffserve.platforms.rocm import RocmPlatform
from diffserve.platforms.xpu import XpuPlatform

# CPU is last: it is always available.
DETECTION_ORDER: tuple[type[Platform], ...] = (
    CudaPlatform,
    RocmPlatform,
    MusaPlatform,
    XpuPlatform,
    NpuPlatform,
    MpsPlatform,
    CpuPlatform,
)

PLATFORMS_BY_NAME: dict[str, type[Platform]] = {cls.name: cls for cls in DETECTION_ORDER}


class PlatformUnavailableError(RuntimeError):
    """The user asked for a platform this machine does not have."""


def detect_platform() -> Platform:
    """The first platform of `DETECTION_ORDER` whose runtime sees a device."""
    for cls in DETECTION_ORDER:
        if cls.is_available():
            return cls()
    raise AssertionError("CpuPlatform.is_available() is always True")


def platform_by_name(name: str) -> Platform:
    """The platform called `name`; errors when unknown or not available here."""
    key, _, index = name.lower().partition(":")
    if index not in ("", "0"):
        raise PlatformUnavailableError(
            f"device {name!r}: choosing a device index is not supported yet; "
            f"select the device with the vendor's visibility variable (e.g. CUDA_VISIBLE_DEVICES) and pass {key!r}"
        )
    if key == "cuda" and RocmPlatform.is_available():
        key = "rocm"  # torch on ROCm answers to "cuda"; users type it too.
    if key not in PLATFORMS_BY_NAME:
        raise PlatformUnavailableError(
            f"unknown device {name!r}; choose one of: {', '.join(PLATFORMS_BY_NAME)}"
        )
    cls = PLATFORMS_BY_NAME[key]
    if not cls.is_available():
        raise PlatformUnavailableError(f"device {key!r} was requested but its runtime sees no device here")
    return cls()


def resolve_platform(name: str | None) -> Platform:
    """A new `Platform` for `--device NAME`, or the detected one when `name` is None (nothing remembered)."""
    return detect_platform() if name is None else platform_by_name(name)


__all__ = [
    "DETECTION_ORDER",
    "PLATFORMS_BY_NAME",
    "CpuPlatform",
    "CudaPlatform",
    "MemoryInfo",
    "MpsPlatform",
    "MusaPlatform",
    "NpuPlatform",
    "Platform",
    "PlatformUnavailableError",
    "RocmPlatform",
    "XpuPlatform",
    "detect_platform",
    "platform_by_name",
    "resolve_platform",
]
