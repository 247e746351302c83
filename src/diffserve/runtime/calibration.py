"""Memory calibration at warm-up: the peak memory of two one-step requests of different sizes (each run
twice, keeping the higher peak), their denoising and decoding phases measured apart (device memory on
accelerators, VmHWM on a Linux CPU)."""

from __future__ import annotations

import logging
from dataclasses import replace

from diffserve.configs.sampling_params import SamplingParams
from diffserve.platforms.base import Platform
from diffserve.request import Req
from diffserve.runtime.contract import PipelineFacts
from diffserve.runtime.engine import Engine
from diffserve.runtime.memory import (
    NO_OFFLOAD,
    MemoryModel,
    PhasePeaks,
    WeightResidency,
    estimated_memory_model,
    measured_memory_model,
)

logger = logging.getLogger("diffserve.runtime")

#: Runs of each calibration probe; the fit takes each phase's highest peak over them.
PROBE_REPEATS = 2


def _new_window(platform: Platform) -> int:
    """Free cached memory, restart the peak counter and return its starting value (what is resident)."""
    platform.synchronize()
    platform.empty_cache()
    platform.reset_peak_memory()
    base = platform.memory_info().peak_bytes
    if base is None:
        raise RuntimeError(f"{platform.name} reports a peak counter but no peak")
    return base


def _measure(engine: Engine, params: SamplingParams) -> PhasePeaks:
    """Run one request alone and read each phase's peak above what was resident when it began."""
    platform = engine.platform
    base = _new_window(platform)
    marks: dict[str, int] = {}

    def at_each_step(req: Req) -> None:
        if req.is_denoised:  # the denoising phase is over; decoding comes next
            platform.synchronize()
            marks["denoise"] = (platform.memory_info().peak_bytes or 0) - base
            marks["decode_base"] = _new_window(platform)

    sr = engine.submit(Req(params=params, on_step=at_each_step))
    engine.run_to_completion([sr])
    if sr.state != "finished":
        raise RuntimeError(f"the calibration request ended {sr.state}") from sr.error
    # The engine read the peak right after decoding (`sr.peak_memory_bytes`), before the slot was freed.
    decode = (sr.peak_memory_bytes or 0) - marks["decode_base"]
    return PhasePeaks(sr.cost, marks["denoise"], decode)


def _peak_of_repeats(engine: Engine, params: SamplingParams) -> PhasePeaks:
    """Each phase's highest peak over `PROBE_REPEATS` runs of one probe. A single run can read low (on the
    CPU, VmHWM misses what reuses pages the allocator kept), and a low probe tilts the fitted line under
    the requests it must bound; a high reading only adds headroom."""
    runs = [_measure(engine, params) for _ in range(PROBE_REPEATS)]
    return PhasePeaks(
        runs[0].cost,
        max(run.denoise_bytes for run in runs),
        max(run.decode_bytes for run in runs),
    )


def calibration_params(facts: PipelineFacts, params: SamplingParams) -> SamplingParams:
    """A video probe decodes a full chunk after the first frame (temporal_factor + 1 frames), so the peak
    seen includes a whole decoder call and the causal cache carried into it; images as given."""
    if not facts.makes_video:
        return params
    return replace(params, num_frames=facts.temporal_factor + 1)


def calibrate_memory_model(
    engine: Engine,
    probe_params: list[SamplingParams],
    mem_fraction: float,
    weights: WeightResidency = NO_OFFLOAD,
) -> MemoryModel:
    """Measured where the platform has a resettable peak counter, else estimated (logged). `weights`:
    the offloaded components' terms (`offload.weight_residency`); with any, the estimate is used (the
    probes' peaks would hold weights moving in, not activations)."""
    facts, platform = engine.pipeline.facts, engine.platform
    if len(probe_params) < 2:
        raise ValueError(f"calibration needs two probe requests of different sizes, got {len(probe_params)}")
    if not platform.has_peak_counter():
        logger.info("Memory model estimated: %s has no resettable peak-memory counter", platform.name)
        return estimated_memory_model(facts, platform, mem_fraction, weights)
    if weights.swap_bytes:
        return measured_memory_model(facts, platform, [], mem_fraction, weights)  # logs why, estimates
    points = [_peak_of_repeats(engine, calibration_params(facts, params)) for params in probe_params]
    platform.empty_cache()
    return measured_memory_model(facts, platform, points, mem_fraction, weights)
