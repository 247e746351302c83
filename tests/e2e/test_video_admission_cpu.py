"""A tiny Wan 2.1 on the CPU: the memory model calibrated at warm-up (VmHWM) admits the video requests a
24 GB machine can make (issue 17: 832x480 x 65 frames was refused at 50,997 MB, yet took 1.4 GB), and its
estimate of a clip it decodes is close above the peak measured."""

from __future__ import annotations

import gc
import os

import pytest

from diffserve import DiffGenerator
from diffserve.configs.sampling_params import SamplingParams
from diffserve.families.wan.tiny import build_tiny_wan
from diffserve.platforms.cpu import read_vm_hwm_bytes, vm_hwm_resets
from diffserve.request import Req
from diffserve.runtime.calibration import calibrate_memory_model
from diffserve.runtime.memory import MB, MemoryModel

GB = 2**30
#: Calibration probe sides: small, to keep the test short (the server uses runtime.memory.CALIBRATION_SIDES).
PROBE_SIDES = (64, 128)


def video(height: int, width: int, frames: int) -> SamplingParams:
    return SamplingParams("a red fox", height=height, width=width, num_frames=frames, num_inference_steps=1)


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> DiffGenerator:
    if not vm_hwm_resets():
        pytest.skip("VmHWM cannot be reset here (not Linux, or /proc/self/clear_refs refused)")
    root = build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"))
    return DiffGenerator.from_pretrained(str(root), device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def calibrated(wan: DiffGenerator) -> MemoryModel:
    probes = [SamplingParams("calibration", height=s, width=s, num_inference_steps=1) for s in PROBE_SIDES]
    # The median of three calibrations, as with the peaks below. VmHWM readings err both ways: pages another
    # thread touches meanwhile raise one (a loaded machine once measured a slope 1.6x an idle one's), and in
    # a process that ran other tests first the allocator hands back pages it kept, which do not raise it
    # (slopes [1623, 1251, 1932] there, the smallest under the peak: the fresh-clone suite failed on it);
    # two calibrations of one idle run differ by up to 1.5x.
    models = sorted(
        (calibrate_memory_model(wan.engine, probes, mem_fraction=0.9) for _ in range(3)),
        key=lambda m: m.bytes_per_pixel,
    )
    model = models[1]
    print("calibrated:", model.describe(), "slopes:", [m.bytes_per_pixel for m in models])
    assert model.source == "measured"
    return model


def measured_peak(wan: DiffGenerator, params: SamplingParams):
    """Run `params` alone; its cost and the process's peak RSS above what was resident before it."""
    platform = wan.engine.platform
    gc.collect()
    platform.empty_cache()
    platform.reset_peak_memory()
    base = read_vm_hwm_bytes()
    sr = wan.engine.submit(Req(params=params))
    wan.engine.run_to_completion([sr])
    assert sr.state == "finished"
    return sr.cost, read_vm_hwm_bytes() - base


def test_the_issue_requests_are_admitted_under_20_gb(wan: DiffGenerator, calibrated: MemoryModel) -> None:
    calibrated.budget_bytes = 20 * GB
    for height, width, frames in [(480, 832, 65), (480, 832, 81)]:
        req = wan.engine.runner.validate(Req(params=video(height, width, frames)))
        cost = wan.engine.cost(req)
        print(f"{width}x{height}x{frames}: estimated {calibrated.estimate(cost) / MB:.0f} MB")
        calibrated.check_alone(cost)


def test_the_estimate_is_close_above_the_measured_peak(wan: DiffGenerator, calibrated: MemoryModel) -> None:
    # The median of three runs' peaks: VmHWM readings err both ways (see `calibrated`).
    runs = [measured_peak(wan, video(240, 416, 9)) for _ in range(3)]
    estimate = calibrated.estimate(runs[0][0])
    peak = sorted(p for _, p in runs)[1]
    report = (
        f"416x240x9: peaks {[round(p / MB) for _, p in runs]} MB, estimated {estimate / MB:.0f} MB "
        f"({calibrated.describe()})"
    )
    print(report)
    assert 0.9 * peak <= estimate <= 3 * peak, report


@pytest.mark.skipif(
    os.environ.get("DIFFSERVE_SLOW_TESTS") != "1",
    reason="decoding 832x480 x 65 frames takes minutes on a small CPU; set DIFFSERVE_SLOW_TESTS=1",
)
def test_the_issue_request_measured(wan: DiffGenerator, calibrated: MemoryModel) -> None:
    cost, peak = measured_peak(wan, video(480, 832, 65))
    estimate = calibrated.estimate(cost)
    print(f"832x480x65: measured {peak / MB:.0f} MB, estimated {estimate / MB:.0f} MB")
    assert 0.9 * peak <= estimate <= 4 * peak and estimate < 20 * GB
