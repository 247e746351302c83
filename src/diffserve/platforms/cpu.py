"""CPU platform: always available, the last entry of the detection order."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from diffserve import openmp_env
from diffserve.platforms.base import MemoryInfo, Platform, set_torch_threads
from diffserve.platforms.step_timer import HostMark, StepMark

logger = logging.getLogger("diffserve.platform")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 2**20  # smaller allocations come from the (reused) heap, not fresh mmaps
TRIM_THRESHOLD_BYTES = 4 * 2**30  # freed heap memory kept, not given back to the OS, up to this

PROC_STATUS = Path("/proc/self/status")
#: Writing "5" here resets this process's VmHWM (peak RSS) to its current RSS (Linux >= 4.0, proc(5)).
CLEAR_REFS = Path("/proc/self/clear_refs")


#: This process's cgroups (proc(7)): `0::/path` on cgroup v2, `N:cpu,cpuacct:/path` on v1.
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_MOUNT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, numactl, `docker --cpuset-cpus`, a
    Kubernetes static CPU policy); all the machine's where the OS has no affinity call (macOS, Windows)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("QUOTA PERIOD" in microseconds, or "max PERIOD") as CPUs; None: no limit."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


def _cpu_limit_v2(folder: Path) -> float | None:
    text = _read_text(folder / "cpu.max")
    return None if text is None else parse_cpu_max(text)


def _cpu_limit_v1(folder: Path) -> float | None:
    """cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` (a quota of -1: no limit)."""
    quota, period = _read_text(folder / "cpu.cfs_quota_us"), _read_text(folder / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    try:
        return parse_cpu_max(f"{int(quota)} {int(period)}")
    except ValueError:
        return None


def cgroup_cpu_quota(proc_cgroup: Path = PROC_CGROUP, mount: Path = CGROUP_MOUNT) -> float | None:
    """The CPUs' worth of time this process's cgroup may use per period (`docker --cpus`, a Kubernetes CPU
    limit): the smallest quota along its cgroup path, from its own group up to the mount's root (inside a
    container that root is the container's group); None where there is none or nothing is readable
    (not Linux). cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    text = _read_text(proc_cgroup)
    if text is None:
        return None
    limits = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        reader: Callable[[Path], float | None]
        if hierarchy == "0" and not controllers:
            roots, reader = [mount, mount / "unified"], _cpu_limit_v2  # unified: a hybrid v1/v2 host
        elif "cpu" in controllers.split(","):
            roots, reader = [mount / controllers, mount / "cpu"], _cpu_limit_v1
        else:
            continue
        parts = [part for part in group.split("/") if part and part not in (".", "..")]
        for root in roots:
            for depth in range(len(parts), -1, -1):
                if (limit := reader(root.joinpath(*parts[:depth]))) is not None:
                    limits.append(limit)
    return min(limits, default=None)


def usable_cpus(affinity: int, quota: float | None) -> int:
    """Whole CPUs a process may keep busy: `affinity` CPUs, capped by the cgroup `quota` (in CPUs) rounded
    down (a thread beyond the quota is throttled for the rest of each period, and every parallel region
    waits for it); at least 1."""
    cpus = affinity if quota is None else min(affinity, math.floor(quota))
    return max(1, cpus)


def available_cpus() -> int:
    """`usable_cpus` of this process (its affinity mask and cgroup quota, read now)."""
    return usable_cpus(affinity_cpus(), cgroup_cpu_quota())


class _TorchThreads:
    """torch's thread count as the program (not diffserve) last left it: an automatic choice never raises
    it (a program or test that lowered it keeps its choice), and one engine's choice (1 thread per rank of
    a 2-rank engine) does not shrink the next engine's."""

    def __init__(self) -> None:
        self.program: int | None = None
        self.ours: int | None = None

    def program_choice(self) -> int:
        current = torch.get_num_threads()
        if self.program is None or current != self.ours:  # first call, or changed since diffserve set it
            self.program = current
        return self.program

    def set(self, threads: int) -> None:
        set_torch_threads(threads)
        self.ours = torch.get_num_threads()


_TORCH_THREADS = _TorchThreads()


def choose_cpu_threads(
    cpu_threads: int | None, processes: int = 1, *, cpus: int | None = None, program: int | None = None
) -> tuple[int, str]:
    """The intra-op thread count and where it comes from: `cpu_threads` (`--cpu-threads`) when given; else
    torch's current count when `OMP_NUM_THREADS` is set (torch took it from there); else the whole CPUs
    this process may use (`available_cpus`) shared among the `processes` ranks on this machine, and no more
    than torch's count as the program left it (`program`)."""
    if cpu_threads is not None:
        return cpu_threads, "--cpu-threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    cpus = available_cpus() if cpus is None else cpus
    share = max(1, cpus // max(1, processes))
    per = f" / {processes} ranks" if processes > 1 else ""
    if program is not None and program < share:
        return program, f"torch's thread count as set before (automatic: {share})"
    return share, f"automatic: {cpus} CPUs this process may use{per}"


def wait_policy() -> str:
    """How this process's OpenMP threads wait, for the log: the variable that decides it, and who set it."""
    applied = openmp_env.APPLIED
    if applied and openmp_env.TORCH_LOADED_FIRST:
        return "spinning (torch was imported before diffserve, so OpenMP kept its default)"
    if applied:
        return "passive (OMP_WAIT_POLICY=PASSIVE, KMP_BLOCKTIME=0: set by diffserve)"
    chosen = [f"{name}={os.environ[name]}" for name in openmp_env.WAIT_VARIABLES if name in os.environ]
    return f"as the environment sets it ({', '.join(chosen)})"


@functools.cache
def _warn_spinning_once() -> None:
    logger.warning(
        "torch was imported before diffserve, so this process's OpenMP threads spin while they wait (the "
        "wait policy is read once, when torch loads): with other processes busy on these CPUs, steps can "
        "be 5-50x slower. Import diffserve before torch, set OMP_WAIT_POLICY=PASSIVE in the environment, "
        "or pass cpu_threads=1 (the processes diffserve starts already wait passively)"
    )


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, where this is Linux with glibc (its `mallopt` / `malloc_trim`); None elsewhere."""
    if not sys.platform.startswith("linux") or (name := ctypes.util.find_library("c")) is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _tune_glibc_malloc() -> bool:
    """Keep big activation buffers in glibc's heap instead of fresh mmaps that every step page-faults back
    in (`--tune-allocator`); returns whether glibc accepted the settings."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)  # not glibc (musl has no mallopt)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _trim_glibc_heap() -> bool:
    """Give glibc's free heap pages back to the OS (`malloc_trim(0)`), so RSS counts only live memory."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)  # its result says only whether pages were released
    return True


def _status_kib(*keys: str) -> dict[str, int] | None:
    """Fields of /proc/self/status (values in KiB) read in one go; None off Linux or when a key is missing."""
    try:
        lines = PROC_STATUS.read_text().splitlines()
    except OSError:
        return None
    values = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if k in keys}
    return values if len(values) == len(keys) else None


def read_vm_hwm_bytes() -> int | None:
    """This process's peak resident set size since it started or since `reset_vm_hwm` (VmHWM); None
    where /proc/self/status has no VmHWM (not Linux)."""
    status = _status_kib("VmHWM")
    return None if status is None else status["VmHWM"] * 1024


def reset_vm_hwm() -> bool:
    """Restart the VmHWM peak at the current RSS; False where the kernel does not allow it."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


VM_HWM_RESET_TRIES = 5
#: What the reset check touches and frees, so that VmHWM stands this far above the RSS before its reset.
VM_HWM_PROBE_BYTES = 16 * 2**20


def _peak_after_touching_probe_kib() -> int | None:
    """VmHWM (KiB) after `VM_HWM_PROBE_BYTES` of fresh pages were touched and unmapped: at least that much
    above the RSS now, so that a reset has a gap to close. None off Linux."""
    block = mmap.mmap(-1, VM_HWM_PROBE_BYTES)
    try:
        block[:: mmap.PAGESIZE] = b"\x01" * (VM_HWM_PROBE_BYTES // mmap.PAGESIZE)
    finally:
        block.close()
    status = _status_kib("VmHWM")
    return None if status is None else status["VmHWM"]


def _reset_lowers_the_peak() -> bool:
    """Whether a reset takes back at least half of the probe's peak. Not `VmHWM <= VmRSS` after the reset:
    that holds with no working reset in a process at its peak, and fails with one that works when the RSS
    moves between the reset and the reading (a child process's check failed on all its tries that way while
    its parent's passed, and the child's memory model fell back to the estimate)."""
    high = _peak_after_touching_probe_kib()
    if high is None or not reset_vm_hwm():
        return False
    low = _status_kib("VmHWM")
    half_probe_kib = VM_HWM_PROBE_BYTES // 1024 // 2
    return low is not None and low["VmHWM"] <= high - half_probe_kib


@functools.cache
def vm_hwm_resets() -> bool:
    """Whether VmHWM can be read and reset here: a reset made after touching and freeing a probe block
    lowers it by at least half the block. Another thread allocating between the reset and the reading can
    hide it (a loaded machine widens that window), so a reset that works shows on one of
    `VM_HWM_RESET_TRIES` tries. Checked once per process; the answer is logged."""
    if not reset_vm_hwm():
        why = f"cannot write {CLEAR_REFS} (not Linux, or a kernel without it)"
    elif any(_reset_lowers_the_peak() for _ in range(VM_HWM_RESET_TRIES)):
        logger.info("CPU peak memory: VmHWM, reset through %s", CLEAR_REFS)
        return True
    else:
        why = (
            f"a reset through {CLEAR_REFS} did not lower VmHWM after {VM_HWM_PROBE_BYTES >> 20} MiB were "
            f"touched and freed, on {VM_HWM_RESET_TRIES} tries"
        )
    logger.warning(
        "CPU peak memory: %s; the memory model stays estimated and the peak reported is the process's "
        "lifetime peak RSS",
        why,
    )
    return False


def _process_peak_rss_bytes() -> int | None:
    """Peak resident set size of this process over its lifetime (Linux reports ru_maxrss in KiB, macOS in
    bytes); None on Windows."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dispatch_key = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def default_dtype(self) -> torch.dtype:
        # bf16 matmuls are much slower than fp32 on CPUs without AMX.
        return torch.float32

    def prepare_process(self) -> None:
        if _tune_glibc_malloc():
            logger.info(
                "CPU allocator: glibc mmap threshold %d MiB, trim threshold %d GiB (activations stay "
                "mapped between steps)",
                MMAP_THRESHOLD_BYTES >> 20,
                TRIM_THRESHOLD_BYTES >> 30,
            )
        else:
            logger.info("CPU allocator: default (not glibc; activations may be re-mapped every step)")

    def configure_threads(self, cpu_threads: int | None, processes: int = 1) -> int:
        """torch's threads from `choose_cpu_threads` (the README's hardware notes), set for the intra-op
        and inter-op pools and logged with how OpenMP waits."""
        program = _TORCH_THREADS.program_choice()  # before any change: what the program left
        threads, source = choose_cpu_threads(cpu_threads, processes, program=program)
        _TORCH_THREADS.set(threads)
        logger.info("CPU threads: %d (%s); OpenMP waits: %s", threads, source, wait_policy())
        if threads > 1 and openmp_env.APPLIED and openmp_env.TORCH_LOADED_FIRST:
            _warn_spinning_once()
        return threads

    def step_mark(self) -> StepMark:
        """The host clock: CPU ops have finished when they return, so there is nothing to wait for."""
        return HostMark()

    def memory_info(self, index: int | None = None) -> MemoryInfo:
        """Peak RSS since the last `reset_peak_memory` (VmHWM) where it resets, else the lifetime peak."""
        vm = psutil.virtual_memory()
        peak = read_vm_hwm_bytes() if vm_hwm_resets() else None
        if peak is None and (peak := _process_peak_rss_bytes()) is None:
            peak = psutil.Process().memory_info().rss
        return MemoryInfo(peak_bytes=peak, available_bytes=vm.available, total_bytes=vm.total)

    def has_peak_counter(self) -> bool:
        return vm_hwm_resets()

    def peak_counter_is_noisy(self) -> bool:
        return True

    def reset_peak_memory(self, index: int | None = None) -> None:
        if vm_hwm_resets():
            reset_vm_hwm()

    def empty_cache(self) -> None:
        """Hand glibc's free heap pages back, so the RSS (and free memory) measured next counts only live
        memory: a peak measured from an RSS that still holds freed pages would miss what reuses them."""
        _trim_glibc_heap()

    def device_name(self, index: int | None = None) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"
