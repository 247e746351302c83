"""Issue 31 item 6: the CPU thread defaults that degrade gracefully when other processes share the CPUs.
The thread count comes from the CPUs this process may use (affinity mask, cgroup quota), `--cpu-threads`
overrides it, and OpenMP waits passively unless the user chose otherwise. Readings and choices only: the
wall-clock effect is measured by benchmarks/bench_cpu_contention.py, not here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffserve.openmp_env import PASSIVE_WAIT, apply_passive_wait
from diffserve.platforms import cpu
from diffserve.platforms.cpu import (
    CpuPlatform,
    affinity_cpus,
    cgroup_cpu_quota,
    choose_cpu_threads,
    parse_cpu_max,
    usable_cpus,
)


@pytest.fixture
def torch_threads():
    """Restore torch's thread count (and diffserve's record of it) after a test changes it."""
    threads = torch.get_num_threads()
    state = vars(cpu._TORCH_THREADS).copy()
    yield
    torch.set_num_threads(threads)
    vars(cpu._TORCH_THREADS).update(state)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# -- readings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000\n", None), ("150000 100000\n", 1.5), ("200000 100000", 2.0), ("50000 100000", 0.5),
     ("", None), ("garbage", None), ("-1 100000", None), ("100000 0", None)],
)  # fmt: skip
def test_cgroup_v2_cpu_max_is_read_as_cpus(text, cpus):
    assert parse_cpu_max(text) == cpus


def test_cgroup_v2_quota_is_the_smallest_along_the_path(tmp_path):
    proc, mount = tmp_path / "cgroup", tmp_path / "fs"
    write(proc, "0::/kubepods/pod1/container\n")
    write(mount / "kubepods/pod1/container/cpu.max", "max 100000\n")
    write(mount / "kubepods/pod1/cpu.max", "250000 100000\n")  # the pod's limit: 2.5 CPUs
    write(mount / "kubepods/cpu.max", "800000 100000\n")
    assert cgroup_cpu_quota(proc, mount) == 2.5


def test_cgroup_v2_inside_a_container_reads_the_mount_root(tmp_path):
    proc, mount = tmp_path / "cgroup", tmp_path / "fs"
    write(proc, "0::/\n")
    write(mount / "cpu.max", "150000 100000\n")  # docker --cpus 1.5
    assert cgroup_cpu_quota(proc, mount) == 1.5


def test_cgroup_v1_quota_and_hybrid_hosts(tmp_path):
    proc, mount = tmp_path / "cgroup", tmp_path / "fs"
    write(proc, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(mount / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    write(mount / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(mount / "unified/cpu.max", "max 100000\n")  # the hybrid host's v2 hierarchy: no limit there
    assert cgroup_cpu_quota(proc, mount) == 0.5


def test_no_quota_or_nothing_readable_is_none(tmp_path):
    proc, mount = tmp_path / "cgroup", tmp_path / "fs"
    assert cgroup_cpu_quota(proc, mount) is None  # no /proc/self/cgroup (not Linux)
    write(proc, "1:cpu:/\n0::/\n")
    write(mount / "cpu/cpu.cfs_quota_us", "-1\n")  # v1: no limit
    write(mount / "cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(proc, mount) is None


def test_affinity_mask_counts_and_falls_back_to_cpu_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert affinity_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert affinity_cpus() == 6


@pytest.mark.parametrize(
    ("affinity", "quota", "cpus"),
    [(8, None, 8), (8, 2.5, 2), (8, 0.5, 1), (2, 4.0, 2), (1, None, 1)],
)
def test_quota_caps_the_affinity_mask_rounded_down(affinity, quota, cpus):
    assert usable_cpus(affinity, quota) == cpus


# -- the choice -------------------------------------------------------------------------------------


def test_thread_choice(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert choose_cpu_threads(3, cpus=8) == (3, "--cpu-threads")
    assert choose_cpu_threads(None, cpus=8)[0] == 8
    assert choose_cpu_threads(None, 2, cpus=8)[0] == 4  # 2 ranks on this machine share its CPUs
    assert choose_cpu_threads(None, 4, cpus=2)[0] == 1
    assert choose_cpu_threads(None, cpus=8, program=2)[0] == 2  # never above what the program set
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert choose_cpu_threads(None, cpus=8) == (torch.get_num_threads(), "OMP_NUM_THREADS")
    assert choose_cpu_threads(5, cpus=8) == (5, "--cpu-threads")


def test_configure_threads_applies_the_option_and_the_automatic_count(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "available_cpus", lambda: 2)
    platform = CpuPlatform()
    torch.set_num_threads(2)
    assert platform.configure_threads(1) == 1
    assert torch.get_num_threads() == 1
    # Automatic again: back to the CPUs it may use, not stuck at the previous engine's choice.
    assert platform.configure_threads(None) == 2
    assert torch.get_num_threads() == 2
    assert platform.configure_threads(None, processes=2) == 1  # one of 2 ranks
    assert platform.configure_threads(None) == 2
    torch.set_num_threads(1)  # the program lowered it itself: automatic keeps its choice
    assert platform.configure_threads(None) == 1


def test_engine_applies_cpu_threads_before_loading(tmp_path, monkeypatch):
    """`cpu_threads` (`--cpu-threads`) reaches the platform before the model loads (and ranks start)."""
    import diffserve.api as api

    calls = []
    monkeypatch.setattr(
        CpuPlatform, "configure_threads", lambda self, n, processes=1: calls.append((n, processes))
    )

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(api, "load_model", stop)
    with pytest.raises(Stop):
        api.DiffGenerator.from_pretrained(str(tmp_path), device="cpu", show_progress=False, cpu_threads=3)
    with pytest.raises(Stop):
        api.DiffGenerator.from_pretrained(str(tmp_path), device="cpu", show_progress=False)
    assert calls == [(3, 1), (None, 1)]


# -- the wait policy --------------------------------------------------------------------------------


def test_passive_wait_is_set_unless_the_user_chose():
    env: dict[str, str] = {}
    assert apply_passive_wait(env) == PASSIVE_WAIT
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env = {name: "42"}
        assert apply_passive_wait(env) == {}
        assert env == {name: "42"}


def test_importing_diffserve_sets_the_policy_before_torch_loads():
    """OpenMP reads the policy once, when torch loads it: `import diffserve` must set it without importing
    torch (processes diffserve starts inherit it)."""
    code = "import os, sys, diffserve; print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))"
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "PASSIVE"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's choice stands
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "ACTIVE"]
