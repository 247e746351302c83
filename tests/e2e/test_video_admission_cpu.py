"""A tiny Wan 2.1 on the CPU: the memory model calibrated at warm-up (VmHWM) admits the video requests a
24 GB machine can make (issue 17: 832x480 x 65 frames was refused at 50,997 MB, yet took 1.4 GB), and its
estimate of a clip it decodes is close above the peak measured.

The calibration and the peaks are measured in a fresh child process: VmHWM readings in a test worker that
ran other tests first depend on what its allocator kept from them (pages handed back without raising the
peak), which made the fresh-clone suite fail where the same file alone passed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from diffserve.platforms.cpu import vm_hwm_resets
from diffserve.runtime.memory import MB
from diffserve.testing.json_child import run_json_child

GB = 2**30

#: The child: builds the tiny Wan, calibrates three times (probes 64 and 128 px: small, to keep the test
#: short; the server uses runtime.memory.CALIBRATION_SIDES) and keeps the median, estimates the issue's
#: requests under a 20 GB budget, and measures the peak of `measure` (height, width, frames) three times.
#: Prints one JSON line.
CHILD = r"""
import gc, json, sys
from pathlib import Path
from diffserve import DiffGenerator
from diffserve.configs.sampling_params import SamplingParams
from diffserve.families.wan.tiny import build_tiny_wan
from diffserve.platforms.cpu import read_vm_hwm_bytes, vm_hwm_resets
from diffserve.request import Req
from diffserve.runtime.calibration import calibrate_memory_model
from diffserve.runtime.memory import RequestTooLargeError

folder, measure = Path(sys.argv[1]), [tuple(json.loads(a)) for a in sys.argv[2:]]
def video(height, width, frames):
    return SamplingParams("a red fox", height=height, width=width, num_frames=frames, num_inference_steps=1)
wan = DiffGenerator.from_pretrained(str(build_tiny_wan(folder)), device="cpu", show_progress=False)
probes = [SamplingParams("calibration", height=s, width=s, num_inference_steps=1) for s in (64, 128)]
# The median of three: two calibrations of one idle run differ by up to 1.5x.
models = sorted((calibrate_memory_model(wan.engine, probes, mem_fraction=0.9) for _ in range(3)),
                key=lambda m: m.bytes_per_pixel)
model = models[1]
model.budget_bytes = 20 * 2**30
admitted = {}
for height, width, frames in [(480, 832, 65), (480, 832, 81)]:
    cost = wan.engine.cost(wan.engine.runner.validate(Req(params=video(height, width, frames))))
    try:
        model.check_alone(cost)
        admitted[f"{width}x{height}x{frames}"] = model.estimate(cost)
    except RequestTooLargeError as exc:
        admitted[f"{width}x{height}x{frames}"] = f"refused: {exc}"
measured = []
for height, width, frames in measure:
    peaks = []
    for _ in range(3):  # the median of three runs' peaks: VmHWM readings err both ways
        platform = wan.engine.platform
        gc.collect()
        platform.empty_cache()
        platform.reset_peak_memory()
        base = read_vm_hwm_bytes()
        sr = wan.engine.submit(Req(params=video(height, width, frames)))
        wan.engine.run_to_completion([sr])
        assert sr.state == "finished", sr.state
        peaks.append(read_vm_hwm_bytes() - base)
    measured.append({"size": f"{width}x{height}x{frames}", "peaks": peaks, "estimate": model.estimate(sr.cost)})
print(json.dumps({"resets": vm_hwm_resets(), "model": {k: str(v) for k, v in model.describe().items()},
                  "source": model.source,
                  "slopes": [m.bytes_per_pixel for m in models], "admitted": admitted, "measured": measured}))
"""


def run_child(folder: Path, *sizes: tuple[int, int, int]) -> dict:
    report, _ = run_json_child(CHILD, str(folder), *(json.dumps(size) for size in sizes), timeout=900)
    print("calibrated:", report["model"], "slopes:", report["slopes"])
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if not vm_hwm_resets():
        pytest.skip("VmHWM cannot be reset here (not Linux, or /proc/self/clear_refs refused)")
    return run_child(tmp_path_factory.mktemp("tiny-wan") / "wan", (160, 288, 9))


def test_the_issue_requests_are_admitted_under_20_gb(report: dict) -> None:
    assert report["resets"], "the child's VmHWM check failed where this process's passed (see its log)"
    assert report["source"] == "measured"
    for size, estimate in report["admitted"].items():
        print(
            f"{size}: estimated {estimate / MB:.0f} MB"
            if isinstance(estimate, int)
            else f"{size}: {estimate}"
        )
        assert isinstance(estimate, int) and estimate < 20 * GB, (size, estimate)


def check_close_above(measured: dict, top: float) -> None:
    peak, estimate = sorted(measured["peaks"])[1], measured["estimate"]
    line = f"{measured['size']}: peaks {[round(p / MB) for p in measured['peaks']]} MB, estimated {estimate / MB:.0f} MB"
    print(line)
    assert 0.9 * peak <= estimate <= top * peak, line


def test_the_estimate_is_close_above_the_measured_peak(report: dict) -> None:
    check_close_above(report["measured"][0], top=3)


@pytest.mark.skipif(
    os.environ.get("DIFFSERVE_SLOW_TESTS") != "1",
    reason="decoding 832x480 x 65 frames takes minutes on a small CPU; set DIFFSERVE_SLOW_TESTS=1",
)
def test_the_issue_request_measured(tmp_path: Path) -> None:
    measured = run_child(tmp_path / "wan", (480, 832, 65))["measured"][0]
    check_close_above(measured, top=4)
    assert measured["estimate"] < 20 * GB
