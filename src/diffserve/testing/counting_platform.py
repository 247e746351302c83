"""`CountingPlatform`: the CPU, posing as an accelerator with its own memory, for testing offload.

Its "device" memory is every tensor made by `to_device` (a clone) plus the tensors a test `adopt`s (the
weights loaded straight onto the device): each storage is counted while it lives, through a weakref
finalizer on it, so what is resident is measured apart from the offload code's own bookkeeping. Its
`memory_info` reports that count against a fixed `capacity_bytes`, so a test can also give the
automatic plan a small device."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

from diffserve.platforms.base import MemoryInfo
from diffserve.platforms.cpu import CpuPlatform


class CountingPlatform(CpuPlatform):
    """The CPU with a separate, counted "device" memory of `capacity_bytes`."""

    name = "counting"

    def __init__(self, index: int = 0, capacity_bytes: int = 2**40) -> None:
        super().__init__(index)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes, for the storages on the "device"
        self._peak = 0
        self.copies_to_device = 0
        self.bytes_to_device = 0

    def for_rank(self, local_rank: int) -> CountingPlatform:
        return type(self)(local_rank, self.capacity_bytes)

    def has_separate_device_memory(self) -> bool:
        return True

    # -- the counted device memory -------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        """Bytes of the storages on the "device" now."""
        with self._lock:
            return sum(self._live.values())

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is one of the counted device storages."""
        with self._lock:
            return tensor.untyped_storage().data_ptr() in self._live

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if key in self._live:
                return
            self._live[key] = size
            self._peak = max(self._peak, sum(self._live.values()))
        # Storages keep their Python object while they live, so this fires when the storage is freed.
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            self._live.pop(key, None)

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors` (e.g. a resident component's weights, loaded straight to the device) as device
        memory while they live."""
        for tensor in tensors:
            self._track(tensor)

    # -- the Platform methods offload/ moves tensors with --------------------------------------------

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        self._track(copy)
        with self._lock:
            self.copies_to_device += 1
            self.bytes_to_device += copy.untyped_storage().nbytes()
        return copy

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    # -- memory reporting ----------------------------------------------------------------------------

    def memory_info(self, index: int | None = None) -> MemoryInfo:
        live = self.live_bytes
        with self._lock:
            peak = self._peak
        return MemoryInfo(
            peak_bytes=peak,
            available_bytes=max(self.capacity_bytes - live, 0),
            total_bytes=self.capacity_bytes,
        )

    def has_peak_counter(self) -> bool:
        return True

    def reset_peak_memory(self, index: int | None = None) -> None:
        with self._lock:
            self._peak = sum(self._live.values())

    def empty_cache(self) -> None:
        """Nothing is cached: a freed storage leaves the count at once."""

    def device_name(self, index: int | None = None) -> str:
        return f"counting device ({self.capacity_bytes} bytes)"
