"""The server's probe requests (warm-up, memory calibration, /health_generate, the batch policy's warm-up
measurement) on SkyReels-V2 diffusion-forcing image-to-video, whose input image is the first latent frame of
the window: a one-frame probe was that image alone, so it denoised nothing (0 steps): the warm-up never ran
the DiT, and the batch policy measured nothing. A family now declares its probes' frames
(`PipelineFacts.probe_frames`): the fewest whose window holds a causal block after the image.

In process, as the engine process runs them, on the tiny folders (`make-tiny skyreels-v2-df-i2v`): the
warm-up probe runs the DiT; calibration (through `DiffGenerator.build_memory_model(calibrate=True)`, the
server's call) measures probes whose denoising peak is a real step's. This machine's CPU peak counter
(VmHWM) may not reset, so calibration reads a counting platform: the CPU platform whose peak is what the
DiT's calls since the last reset added (`DIT_BYTES_PER_ELEMENT` per latent element), so a probe's
denoising figure is exactly its DiT calls' and is 0 without one. With 3-frame causal blocks, the old
5-frame calibration probe (2 latent frames) was refused, and calibration fell back to the estimate."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from diffserve import DiffGenerator
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.platforms.base import MemoryInfo, Platform
from diffserve.request import Req
from diffserve.runtime import calibration
from diffserve.runtime.calibration import probe_params
from diffserve.runtime.contract import PipelineFacts
from diffserve.runtime.memory import NO_OFFLOAD, MemoryModel, PhasePeaks, WeightResidency
from diffserve.runtime.step_curve_probe import STEPS_PER_BATCH, measure_step_curve

#: Bytes the counting platform's peak grows by per element of the DiT's latent input, per DiT call.
DIT_BYTES_PER_ELEMENT = 1000
#: The counting platform's resident bytes (its peak's floor).
BASE_BYTES = 10**9


@dataclass
class DitCounter:
    """The DiT's calls and the bytes they added since the last `reset`."""

    calls: int = 0
    bytes: int = 0
    per_call: list[int] = field(default_factory=list)

    def hook(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        latents = kwargs.get("hidden_states", args[0] if args else None)
        assert isinstance(latents, torch.Tensor), "the DiT's first input is its latents"
        added = latents.numel() * DIT_BYTES_PER_ELEMENT
        self.calls += 1
        self.bytes += added
        self.per_call.append(added)


class CountingPlatform:
    """The engine's CPU platform with an exact peak counter: `BASE_BYTES` plus the DiT's bytes since the
    last `reset_peak_memory` (everything else, from `cpu`)."""

    def __init__(self, cpu: Platform, counter: DitCounter) -> None:
        self.cpu = cpu
        self.counter = counter

    def __getattr__(self, name: str) -> object:
        return getattr(self.cpu, name)

    def has_peak_counter(self) -> bool:
        return True

    def peak_counter_is_noisy(self) -> bool:
        return False

    def reset_peak_memory(self, index: int | None = None) -> None:
        self.counter.bytes = 0

    def memory_info(self, index: int | None = None) -> MemoryInfo:
        return MemoryInfo(BASE_BYTES + self.counter.bytes, 8 * 10**9, 16 * 10**9)


def load(tmp_path_factory: pytest.TempPathFactory, block: int) -> DiffGenerator:
    """The tiny DF image-to-video folder with `block` frames per causal block, two running requests (the
    server's `auto` batch policy measures at warm-up then)."""
    spec = TinySkyReelsV2Spec(diffusion_forcing=True, image_to_video=True, num_frame_per_block=block)
    folder = build_tiny_skyreels_v2(tmp_path_factory.mktemp(f"skyreels-df-i2v-{block}"), spec)
    return DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False, max_running_requests=2)


@pytest.fixture
def counted(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[
    tuple[DiffGenerator, DitCounter]
]:  # fmt: skip
    gen = load(tmp_path_factory, request.param)
    counter = DitCounter()
    handle = gen.pipeline.context.get("transformer").register_forward_pre_hook(counter.hook, with_kwargs=True)
    try:
        yield gen, counter
    finally:
        handle.remove()


@pytest.mark.parametrize("counted", [1, 3], indirect=True)
def test_the_warm_up_probe_denoises_a_step(counted: tuple[DiffGenerator, DitCounter]) -> None:
    gen, counter = counted
    facts = gen.pipeline.facts
    params = probe_params(facts, "warm-up")
    runner = gen.engine.runner
    req = runner.pre_denoise(runner.validate(Req(params=params)))
    try:
        steps = req.num_steps
    finally:
        runner.release(req)
    print(f"{facts.name}: {params.num_frames} probe frames, {steps} step(s)")
    assert steps == 1
    gen.generate_from_params(params)  # the server's warm-up
    assert counter.calls >= 1
    # The fewest frames: 2 latent frames (the image's, and one block) with 1-frame blocks; one 3-frame block
    # (the image's frame is in it) with 3-frame blocks.
    block = int(gen.pipeline.context.get("transformer").config.num_frame_per_block)
    assert params.num_frames == facts.probe_frames == {1: 5, 3: 9}[block]


@pytest.mark.parametrize("counted", [1, 3], indirect=True)
def test_calibration_measures_real_steps(
    counted: tuple[DiffGenerator, DitCounter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gen, counter = counted
    engine = gen.engine
    platform = CountingPlatform(engine.platform, counter)
    monkeypatch.setattr(engine, "platform", platform)
    monkeypatch.setattr(engine.runner, "platform", platform)
    points: list[list[PhasePeaks]] = []
    fit = calibration.measured_memory_model

    def recorded(
        facts: PipelineFacts,
        platform: Platform,
        measured: list[PhasePeaks],
        mem_fraction: float,
        weights: WeightResidency = NO_OFFLOAD,
    ) -> MemoryModel:
        """`measured_memory_model`, keeping the calibration's measured phase peaks."""
        points.append(list(measured))
        return fit(facts, platform, measured, mem_fraction, weights)

    monkeypatch.setattr(calibration, "measured_memory_model", recorded)
    with caplog.at_level(logging.INFO, logger="diffserve.runtime"):
        model = gen.build_memory_model(calibrate=True)  # the server's call after its warm-up
    print(caplog.text.strip().splitlines()[-2:])
    assert "Memory calibration failed" not in caplog.text
    assert model.source == "measured" and len(points) == 1
    first, last = points[0]
    # Each probe's denoising peak is its steps' DiT calls (one step, its CFG branches in one call), and the
    # larger probe's is larger: a real step of each.
    assert counter.calls >= 2 * calibration.PROBE_REPEATS
    assert first.denoise_bytes in counter.per_call and last.denoise_bytes in counter.per_call
    assert 0 < first.denoise_bytes < last.denoise_bytes
    assert model.bytes_per_token > 0


@pytest.mark.parametrize("block", [1])
def test_the_batch_policy_measures_batches_of_one_and_two(
    tmp_path_factory: pytest.TempPathFactory, block: int
) -> None:
    gen = load(tmp_path_factory, block)
    assert gen.engine.scheduler.policy.name == "auto"
    measured = measure_step_curve(gen.engine, probe_params(gen.pipeline.facts, "batch curve"), 2)
    curve = gen.engine.scheduler.policy.curve.snapshot()
    print(measured, curve)
    assert measured == [1, 2]
    (points,) = curve.values()  # the probe size's bucket: rows of one request (its CFG branches) and two
    rows = sorted(points, key=int)
    assert len(rows) == 2 and int(rows[1]) == 2 * int(rows[0])
    assert all(point["samples"] == STEPS_PER_BATCH and point["seconds"] > 0 for point in points.values())
