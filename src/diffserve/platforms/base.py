"""`Platform`: what the engine needs to know about one kind of accelerator (device, dtype, memory,
timing); a new vendor is one small subclass plus one line in `DETECTION_ORDER`."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from diffserve.platforms.step_timer import EventMark, HostMark, StepMark

logger = logging.getLogger(__name__)


def set_torch_threads(threads: int) -> None:
    """torch's intra-op threads (`torch.set_num_threads`, which also sets OpenMP's and MKL's) and its
    inter-op pool (`torch.set_num_interop_threads`, which torch takes only before that pool has started:
    later calls keep the pool it has)."""
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() == threads:
        return
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError as exc:  # the pool was set or has run work already
        logger.debug("torch inter-op threads stay %d: %s", torch.get_num_interop_threads(), exc)


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of the platform's device, in bytes; None where the platform cannot tell."""

    peak_bytes: int | None
    available_bytes: int | None
    total_bytes: int | None


class Platform(ABC):
    """One accelerator family, bound to one of its devices: `index` (0 unless this process is one rank of
    several: then its local rank). Its only state is that index; all methods are cheap to call."""

    name: str = ""  # what `--device` and logs call it ("cpu", "cuda", "rocm", ...)
    device_type: str = ""  # the torch device type ("cpu", "cuda", "musa", "xpu", "npu", "mps")
    dispatch_key: str = "native"  # its `CustomOp.forward_<key>`
    #: torch.distributed backend of its ranks' collectives: nccl (cuda, rocm), mccl (musa), xccl (xpu),
    #: hccl (npu), gloo (cpu, mps: on the CPU every rank is one process over gloo).
    dist_backend: str = "gloo"
    #: `--attention-backend` when not given: "auto" lets `layers/attention_backends.py` choose per device.
    default_attention_backend: str = "auto"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def for_rank(self, local_rank: int) -> Platform:
        """The same platform bound to the device of local rank `local_rank` (its device index)."""
        return type(self)(local_rank)

    def bind_device(self) -> None:  # noqa: B027  (optional hook, no-op by default)
        """Make `index` this process's current device (collective backends such as NCCL need it)."""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """True when this platform's runtime is importable and sees at least one device."""

    @property
    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """The dtype DiT/VAE weights run in when the user does not pass `--dtype`."""

    def device(self, index: int | None = None) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.index if index is None else index)

    @abstractmethod
    def memory_info(self, index: int | None = None) -> MemoryInfo:
        """Peak memory since the last reset, available and total memory."""

    def reset_peak_memory(self, index: int | None = None) -> None:  # noqa: B027  (optional hook, no-op by default)
        """Start a new peak-memory window."""

    def has_peak_counter(self) -> bool:
        """Whether `memory_info().peak_bytes` is a peak that `reset_peak_memory` restarts, so that warm-up
        can measure each phase's peak (runtime/calibration.py); else the memory model is estimated."""
        return True

    def peak_counter_is_noisy(self) -> bool:
        """Whether the peak counter reads allocator effects as well as live tensors (a process's VmHWM:
        pages glibc kept or reuses). Calibration then bounds the decode line's slope from below by the
        larger probe's bytes per pixel (runtime/memory.py: `fit_bounding_line`); an exact counter (a device
        allocator's peak) keeps the two-point fit."""
        return False

    def prepare_process(self) -> None:  # noqa: B027  (optional hook, no-op by default)
        """Process-wide allocator tuning (`--tune-allocator`, opt-in: its effect is host-dependent)."""

    def configure_threads(self, cpu_threads: int | None, processes: int = 1) -> int:
        """torch's CPU threads for this process, one of `processes` ranks on this machine: `cpu_threads`
        (`--cpu-threads`) when given; this default leaves torch's own choice otherwise (the CPU platform
        chooses from the CPUs this process may use). Returns the intra-op thread count."""
        if cpu_threads is not None:
            set_torch_threads(cpu_threads)
        return torch.get_num_threads()

    def empty_cache(self) -> None:  # noqa: B027  (optional hook, no-op by default)
        """Give the allocator's cached blocks back (so free memory measured next counts them)."""

    def synchronize(self, index: int | None = None) -> None:  # noqa: B027  (optional hook, no-op by default)
        """Wait for queued device work."""

    def step_mark(self) -> StepMark:
        """A mark in the device's work queue for timing steps; this default synchronizes to make one."""
        self.synchronize()
        return HostMark()

    def device_name(self, index: int | None = None) -> str:
        return self.name

    # -- Moving weights between host and device (offload/ copies only through these) ---------------

    def has_separate_device_memory(self) -> bool:
        """Whether a tensor moved to host memory frees device memory: False where the device's memory is
        the host's (the CPU; Apple's unified memory), so that offloading there saves nothing."""
        return self.device_type not in ("cpu", "mps")

    def pin_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (in host memory) in page-locked memory where the platform has it, so that copies to
        the device can be asynchronous; this default returns it as it is (pageable)."""
        return tensor

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host `tensor` on this platform's device (a copy, queued on the current stream: asynchronous from
        pinned memory, and work queued after it on that stream sees the data; the tensor itself where the
        device is the host)."""
        return tensor.to(self.device(), non_blocking=True)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of device `tensor` in host memory, complete when this returns."""
        return tensor.to("cpu")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_type={self.device_type!r}, index={self.index})"


class TorchAcceleratorPlatform(Platform):
    """Shared logic for runtimes that mirror the `torch.cuda` memory API under `torch.<module>`."""

    runtime_module: str = ""  # `torch.<runtime_module>`: cuda, xpu, musa, ...

    def _runtime(self):
        return getattr(torch, self.runtime_module)

    @classmethod
    def _extension_available(cls, extension: str) -> bool:
        """`is_available` of a runtime an extension package registers (`torch_musa` -> `torch.musa`)."""
        if importlib.util.find_spec(extension) is None:
            return False
        try:
            importlib.import_module(extension)
        except Exception as exc:  # a broken vendor install must not stop detection elsewhere
            logger.warning(
                "%s is installed but failed to import (%s); %s is unavailable", extension, exc, cls.name
            )
            return False
        return hasattr(torch, cls.runtime_module) and getattr(torch, cls.runtime_module).is_available()

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def _index(self, index: int | None) -> int:
        return self.index if index is None else index

    def bind_device(self) -> None:
        self._runtime().set_device(self.index)

    def memory_info(self, index: int | None = None) -> MemoryInfo:
        runtime, index = self._runtime(), self._index(index)
        free, total = runtime.mem_get_info(index)
        return MemoryInfo(runtime.max_memory_allocated(index), free, total)

    def reset_peak_memory(self, index: int | None = None) -> None:
        self._runtime().reset_peak_memory_stats(self._index(index))

    def synchronize(self, index: int | None = None) -> None:
        self._runtime().synchronize(self._index(index))

    def empty_cache(self) -> None:
        self._runtime().empty_cache()

    def step_mark(self) -> StepMark:
        """A timing event on the runtime's current stream: no host sync."""
        return EventMark(self._runtime())

    def device_name(self, index: int | None = None) -> str:
        return str(self._runtime().get_device_name(self._index(index)))

    def pin_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy (`Tensor.pin_memory`): host-to-device copies from it do not block the host."""
        return tensor.pin_memory()
