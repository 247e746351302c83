"""Memory calibration at warm-up: the peak memory of two one-step requests of different sizes, their
denoising and decoding phases measured apart."""

from __future__ import annotations

import logging

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req
from diffserve.runtime.engine import Engine
from diffserve.runtime.memory import MemoryModel, PhasePeaks, estimated_memory_model, measured_memory_model

logger = logging.getLogger("diffserve.runtime")


def _measure(engine: Engine, params: SamplingParams) -> PhasePeaks | None:
    """Run one request alone; None where the platform has no peak counter."""
    platform = engine.platform
    platform.reset_peak_memory()
    base = platform.memory_info().peak_bytes
    if base is None:
        return None
    marks: dict[str, int] = {}

    def at_each_step(req: Req) -> None:
        if req.is_denoised:  # the denoising phase is over; decoding comes next
            platform.synchronize()
            marks["denoise"] = (platform.memory_info().peak_bytes or 0) - base
            platform.reset_peak_memory()
            marks["decode_base"] = platform.memory_info().peak_bytes or 0

    sr = engine.submit(Req(params=params, on_step=at_each_step))
    engine.run_to_completion([sr])
    if sr.state != "finished":
        raise RuntimeError(f"the calibration request ended {sr.state}") from sr.error
    # The engine read the peak right after decoding (`sr.peak_memory_bytes`), before the slot was freed.
    decode = (sr.peak_memory_bytes or 0) - marks["decode_base"]
    return PhasePeaks(sr.cost, marks["denoise"], decode)


def calibrate_memory_model(
    engine: Engine, probe_params: list[SamplingParams], mem_fraction: float
) -> MemoryModel:
    """Measured where the platform has a resettable peak counter (not the CPU), else estimated."""
    facts, platform = engine.pipeline.facts, engine.platform
    if platform.device_type == "cpu" or len(probe_params) < 2:
        return estimated_memory_model(facts, platform, mem_fraction)
    points = []
    for params in probe_params:
        point = _measure(engine, params)
        if point is None:
            return estimated_memory_model(facts, platform, mem_fraction)
        points.append(point)
    platform.empty_cache()
    return measured_memory_model(facts, platform, points, mem_fraction)
