"""The memory model costs what a family generates, not what a request asks for:

- SANA-Video with resolution binning (its default) generates at its bin (64x128 asked -> 448x896 on the
  tiny model); the request's cost, and so admission, counts the bin, and a request over the budget only
  because of its bin is refused with the memory message (naming what to lower).
- HiDream-I1 generates every request at the default area, so both calibration probes land on one size:
  the calibration is a one-point fit whose slopes are the estimate's (not a zero slope that charges every
  request the same).
- `--backend diffusers` probes run two steps: diffusers' MochiPipeline cannot run one (its schedule divides
  by zero), and a probe through the backend with its declared steps runs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from diffserve import DiffGenerator
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.platforms import resolve_platform
from diffserve.registry import TinyCheckpointOptions, family_by_name
from diffserve.request import Req
from diffserve.runtime.calibration import calibration_params, calibration_probes, probe_params
from diffserve.runtime.memory import (
    MEASURED_HEADROOM,
    PhasePeaks,
    RequestTooLargeError,
    estimated_memory_model,
    fit_line,
    measured_memory_model,
    request_cost,
)


def load_tiny(family_name: str, folder: Path, backend: str | None = None) -> DiffGenerator:
    path = family_by_name(family_name).tiny_builder(folder, TinyCheckpointOptions(0))
    args = (
        EngineArgs(model_path=str(path))
        if backend is None
        else EngineArgs(model_path=str(path), backend=backend)
    )
    return DiffGenerator(args, show_progress=False, memory_model=False)


def test_sana_video_binned_request_is_costed_at_its_bin(tmp_path: Path) -> None:
    pipeline = load_tiny("sana-video", tmp_path / "sv").pipeline
    facts = pipeline.facts

    def validated(binning: bool) -> Req:
        params = SamplingParams("a cat", height=64, width=128, num_frames=1, num_inference_steps=2)
        params.extra = {"use_resolution_binning": binning}
        return pipeline.validate(Req(params=params))

    binned, own = validated(True), validated(False)
    assert (binned.params.height, binned.params.width) == (
        64,
        128,
    )  # the size asked (the output is resized back)
    assert binned.generated.size == (448, 896)
    cost, own_cost = request_cost(facts, binned), request_cost(facts, own)
    print("binned cost", cost.height, cost.width, cost.tokens, "own", own_cost.tokens)
    assert (cost.height, cost.width) == (448, 896) and (own_cost.height, own_cost.width) == (64, 128)
    assert cost.tokens == 49 * own_cost.tokens

    # A budget the 64x128 clip fits and its 448x896 bin does not: refused, naming what to lower.
    model = estimated_memory_model(facts, resolve_platform("cpu"), 1.0)
    budget = int((model.estimate(own_cost) + model.estimate(cost)) / 2)
    model = replace(model, budget_bytes=budget)
    print(
        "estimates MB",
        model.estimate(own_cost) / 2**20,
        model.estimate(cost) / 2**20,
        "budget",
        budget / 2**20,
    )
    model.check_alone(own_cost)
    with pytest.raises(RequestTooLargeError, match="generated at 896x448") as caught:
        model.check_alone(cost)
    message = str(caught.value)
    print(message)
    assert "reduce size" not in message  # every 1:2 size asked is generated at the same bin
    assert "128x64 asked" in message and "--mem-fraction" in message


def test_hidream_calibrates_with_a_one_point_fit(tmp_path: Path) -> None:
    generator = load_tiny("hidream-i1", tmp_path / "hd")
    pipeline, facts, platform = generator.pipeline, generator.pipeline.facts, resolve_platform("cpu")
    costs = [
        request_cost(facts, pipeline.validate(Req(params=calibration_params(facts, params))))
        for params in calibration_probes(facts, platform)
    ]
    assert costs[0] == costs[1], "HiDream's area rule generates both probes at one size"
    estimate = estimated_memory_model(facts, platform, 0.9)
    point = costs[0].batch_tokens
    denoise = int(3 * estimate.bytes_per_token * point)  # measured above the line the estimate's slope gives
    points = [PhasePeaks(costs[0], denoise - 10, 50_000), PhasePeaks(costs[1], denoise, 60_000)]
    model = measured_memory_model(facts, platform, points, 0.9)
    print(model.describe())
    assert model.source == "measured (one size)"
    assert model.bytes_per_token == pytest.approx(estimate.bytes_per_token * MEASURED_HEADROOM)
    fixed = (denoise - estimate.bytes_per_token * point) * MEASURED_HEADROOM
    assert model.fixed_bytes == pytest.approx(fixed)
    # The fitted line passes through the higher point (with headroom) and scales with `n`.
    assert model.denoise_bytes(costs[0]) == pytest.approx(denoise * MEASURED_HEADROOM + 64 * costs[0].steps)
    two = replace(costs[0], outputs=2)
    assert model.denoise_bytes(two) > model.denoise_bytes(costs[0]) + estimate.bytes_per_token * point
    with pytest.raises(ValueError, match="same x"):
        fit_line((5.0, 5.0), (1.0, 2.0))


def test_diffusers_backend_probes_run_two_steps(tmp_path: Path) -> None:
    import diffusers.pipelines.mochi.pipeline_mochi as mochi

    with pytest.raises(ZeroDivisionError):  # what a one-step probe met inside diffusers' MochiPipeline
        mochi.linear_quadratic_schedule(1, 0.025)
    generator = load_tiny("mochi", tmp_path / "mochi", backend="diffusers")
    facts = generator.pipeline.facts
    assert facts.probe_steps == 2
    params = probe_params(facts, "warm-up")
    assert params.num_inference_steps == 2
    result = generator.generate_from_params(params)
    print("probe frames", [f.shape for f in result.frames])
    assert result.frames[0].shape[0] == facts.probe_frames
