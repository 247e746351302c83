"""The engine's memory model, built one way for every entry point (`build_memory_model`: the server's
engine process after its warm-up, `DiffGenerator` and `diffserve generate` at load), and its calibration:
the peak memory of two one-step requests of different sizes (each run twice, keeping the higher peak),
their denoising and decoding phases measured apart (device memory on accelerators, VmHWM on a Linux CPU)."""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from diffserve.configs.cache_settings import NoCache
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.platforms.base import Platform
from diffserve.request import Req
from diffserve.runtime.contract import PipelineFacts
from diffserve.runtime.engine import Engine
from diffserve.runtime.memory import (
    CALIBRATION_SIDES,
    CPU_CALIBRATION_SIDES,
    MB,
    NO_OFFLOAD,
    MemoryModel,
    PhasePeaks,
    WeightResidency,
    estimated_memory_model,
    measured_memory_model,
    with_vae_tiling,
)

if TYPE_CHECKING:
    from diffserve.runtime.lora_registry import LoraRegistry

logger = logging.getLogger("diffserve.runtime")

#: Runs of each calibration probe; the fit takes each phase's highest peak over them.
PROBE_REPEATS = 2
#: Warm-up, calibration and health probes draw an image this wide (rounded up to the model's granularity);
#: video families a clip of their `PipelineFacts.probe_frames` (one frame for most).
PROBE_PIXELS = 64


def round_up(pixels: int, multiple: int) -> int:
    """`pixels` rounded up to a multiple of `multiple` (a side the model accepts)."""
    return -(-pixels // multiple) * multiple


def probe_params(facts: PipelineFacts, prompt: str, side: int | None = None) -> SamplingParams:
    """A short request every pipeline accepts: `side` pixels square (default `PROBE_PIXELS`, rounded up
    to the pixel multiple; the family's `probe_size` where it generates one size only), the family's `probe_steps` (one for most) and `probe_extra` settings, with the
    input images and mask the family requires (at the default side) and, for a video family, its
    `probe_frames` (the fewest frames that leave a step to denoise); a family that extends a video gets a
    grey clip of its probe's frames at `side` and one chunk to generate (`PipelineFacts.with_probe_video`).
    The server's warm-up and batch-policy measurement, and calibration, run these."""
    small_height, small_width = facts.probe_side_size(round_up(PROBE_PIXELS, facts.pixel_multiple))
    height, width = facts.probe_side_size(side) if side else (small_height, small_width)
    params = SamplingParams(
        prompt,
        height=height,
        width=width,
        num_inference_steps=facts.probe_steps,
        input_images=facts.probe_images(small_width, small_height),
        mask_image=facts.probe_mask(small_width, small_height),
        num_frames=facts.probe_frames if facts.makes_video else None,
        cache=NoCache(),  # a probe measures the exact path, whatever the engine's --cache-default
    )
    facts.with_probe_settings(params)
    return facts.with_probe_video(params, width, height)


def health_probe_params(facts: PipelineFacts, params: SamplingParams, side: int) -> SamplingParams:
    """/health_generate's request as the front end sends it (`side` pixels square, one step: it knows no
    family), completed in place as every probe of the family: the input images and mask it requires,
    a grey clip where it extends a video, its `probe_frames` where no frame count is set, at least its
    `probe_steps` and its `probe_extra` settings; a family that generates one size only (`probe_size`) gets
    it instead of the square."""
    if facts.probe_size is not None:
        params.height, params.width = facts.probe_size
    height, width = facts.probe_side_size(side)
    if not params.input_images:
        params.input_images = facts.probe_images(width, height)
    if params.mask_image is None:
        params.mask_image = facts.probe_mask(width, height)
    facts.with_probe_video(params, width, height)  # video-to-video: a clip
    if facts.makes_video and params.num_frames is None:
        params.num_frames = facts.probe_frames  # the fewest with a step to denoise
    return facts.with_probe_settings(params)


def calibration_probes(facts: PipelineFacts, platform: Platform) -> list[SamplingParams]:
    """The two calibration requests: `CALIBRATION_SIDES` (`CPU_CALIBRATION_SIDES` on the CPU, where they
    run at CPU speed) rounded up to the model's pixel multiple."""
    sides = CPU_CALIBRATION_SIDES if platform.device_type == "cpu" else CALIBRATION_SIDES
    return [probe_params(facts, "calibration", round_up(side, facts.pixel_multiple)) for side in sides]


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
    """A video probe decodes at least a full chunk after the first frame (temporal_factor + 1 frames), so
    the peak seen includes a whole decoder call and the causal cache carried into it, and has at least the
    family's `probe_frames` (so that it denoises a step); images as given."""
    if not facts.makes_video:
        return params
    return replace(params, num_frames=max(facts.temporal_factor + 1, facts.probe_frames))


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


def lora_reserve_bytes(loras: LoraRegistry | None, args: EngineArgs) -> int:
    """Device bytes the budget keeps for LoRA adapters loaded later: `--max-lora-memory` less the resident
    ones, when LoRA is on (`--lora`, `--lora-dir`) and not merged (merged adapters are part of the weights,
    which the free memory is measured without). Nothing with an unbounded `max_lora_memory`: a one-off
    `diffserve generate` loads every adapter it is given at start, and none later."""
    if loras is None or args.lora_merge or loras.merged or not (args.loras or args.lora_dir):
        return 0
    if loras.max_bytes >= sys.maxsize:
        return 0
    return max(0, loras.max_bytes - loras.resident_bytes)


def build_memory_model(
    engine: Engine,
    args: EngineArgs,
    weights: WeightResidency = NO_OFFLOAD,
    vae: object | None = None,
    calibrate: bool = False,
) -> MemoryModel:
    """The memory model `engine` admits requests by (docs/memory.md), whoever drives it. Its coefficients
    are measured by `calibration_probes` with `calibrate` (the server, after its warm-up) where the platform
    has a peak counter, else estimated from the DiT's width (also when calibration fails, logged). Its
    budget is the free memory now x `args.mem_fraction`, less `lora_reserve_bytes`. `weights`: the
    offloaded components' terms (`offload.weight_residency`); `vae`: the VAE component, whose decode is
    tiled always with `args.vae_tiling`, else automatically (`MemoryModel.decode_tiled`) on one device."""
    facts, platform, fraction = engine.pipeline.facts, engine.platform, args.mem_fraction
    model = None
    if calibrate:
        try:
            model = calibrate_memory_model(engine, calibration_probes(facts, platform), fraction, weights)
        except Exception as exc:
            logger.warning("Memory calibration failed (%r); using the estimated memory model", exc)
    if model is None:
        model = estimated_memory_model(facts, platform, fraction, weights)
    reserved = lora_reserve_bytes(engine.runner.loras, args)
    budget = model.budget_bytes
    if reserved and budget is not None:
        budget = max(0, budget - reserved)
        logger.info(
            "Memory budget: %.0f MB kept for LoRA adapters (--max-lora-memory); %.0f MB left for requests",
            reserved / MB, budget / MB,
        )  # fmt: skip
    model = replace(model, budget_bytes=budget, lora_reserved_bytes=reserved)
    return with_vae_tiling(model, vae, forced=args.vae_tiling, single_device=args.num_gpus == 1)
