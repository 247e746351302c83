"""GPU-marked tests (`@pytest.mark.gpu`, registered in pyproject.toml): skipped where torch sees no CUDA
device, with the reason in the summary (`-ra`); `tools/gpu/check.sh` runs them on a GPU machine.

`DIFFSERVE_GPU_TESTS_DEVICE=cpu` runs them on the CPU instead (what `tools/gpu/check.sh --dry-run` does,
so their code cannot rot while no GPU is lent); the checks that only mean something on a GPU (CUDA graph
replay, FP8 tensor cores, GPU-only attention kernels) skip themselves there, saying so."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE_ENV = "DIFFSERVE_GPU_TESTS_DEVICE"


def gpu_test_device() -> torch.device | None:
    """The device the GPU tests run on: CUDA when present, the CPU when asked by `DEVICE_ENV`, else None."""
    if os.environ.get(DEVICE_ENV) == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and gpu_test_device() is None:
        pytest.skip(
            "needs a CUDA GPU: torch.cuda.is_available() is False here (tools/gpu/check.sh runs these on one; "
            f"{DEVICE_ENV}=cpu runs their code on the CPU)"
        )


@pytest.fixture
def device() -> torch.device:
    found = gpu_test_device()
    assert found is not None  # pytest_runtest_setup skipped the test otherwise
    return found


@pytest.fixture
def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"
