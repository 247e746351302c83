"""How much memory a request needs, how much the engine may use, and the warm-up that measures both.

The model is deliberately simple, three terms per request:

    denoise(r) = fixed + per_token * tokens(r) * branches(r) * outputs(r)
    decode(r)  = decode_fixed + per_pixel * pixels(r) * outputs(r)

`tokens` are the DiT's latent tokens of one output (image area / pixel_multiple², times the latent
frames of a video, plus the tokens of any input images an edit model appends), `branches` is 2 when the
request runs CFG's negative branch in the same batch and 1 otherwise, `pixels` is the decoded output
(times its frames). Running requests hold their denoising activations at the same time (they share a
DiT batch), but decode one after another (post-denoise runs on the engine loop, one request at a time),
so the memory of a running set is

    sum(denoise(r) for r in running) + max(decode(r) for r in running)

An approximate-quality request also keeps its step cache (`models/step_cache.py`: the blocks' last
residual and the last signal, two hidden states of DiT width per token) for its whole run:
`step_cache_per_token * tokens * branches * outputs` on top of its denoising term.

A request is admitted only while that total, with it, stays within the budget: the free memory
measured once after warm-up times `--mem-fraction` (the model's weights are already resident then, so
they are not counted twice).

Calibration (`calibrate_memory_model`): on platforms with a resettable peak counter (CUDA, ROCm, XPU,
...) two one-step generations of different sizes are run phase by phase at warm-up; the peak above the
resident baseline of the denoising phase and of the decoding phase at the two sizes gives the two slopes
and intercepts (a straight-line fit, 10% headroom). On CPU the process's peak RSS cannot be reset, so the
coefficients come from the DiT's width instead (`estimated_memory_model`): generous, and against a budget
of the available RAM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import UserError

logger = logging.getLogger("diffserve.runtime")

MB = 2**20
#: Measured coefficients are scaled by this: peaks vary a little from run to run (allocator rounding).
MEASURED_HEADROOM = 1.1
#: Side in pixels of the two calibration generations (rounded to the model's granularity).
CALIBRATION_SIDES = (256, 512)
#: The CPU estimate: bytes of live activations per latent token per unit of DiT width (hidden states,
#: q/k/v, attention output, the 4x MLP and its activation, residual copies: about 24 widths), per
#: decoded output pixel (the VAE's last blocks run 128 channels at full resolution, a few tensors
#: live at once), and per request (embeddings, latents, the scheduler's state).
ESTIMATED_WIDTHS_PER_TOKEN = 24
ESTIMATED_BYTES_PER_PIXEL_PER_ELEMENT = 4 * 128
ESTIMATED_FIXED_BYTES = 64 * MB
#: DiT width assumed when the transformer does not say (FLUX.1's).
DEFAULT_DIT_WIDTH = 3072


class RequestTooLargeError(UserError):
    """The request alone needs more memory than the engine may use; the message gives the numbers
    and what to reduce (the server answers 413)."""

    param = "size"


@dataclass(frozen=True)
class RequestCost:
    """What a request occupies while it runs (see the module docstring for the units)."""

    #: DiT latent tokens of one output, one branch (input images' tokens included).
    tokens: int
    #: 2 when the request runs CFG's negative branch in the same DiT batch, else 1.
    branches: int
    #: Outputs (`n` / num_outputs_per_prompt).
    outputs: int
    #: Decoded pixels of one output (times its frames for a video).
    pixels: int
    #: The request runs an approximate quality tier and holds a step cache while it runs.
    step_cache: bool = False

    @property
    def batch_tokens(self) -> int:
        """Tokens this request adds to every DiT batch it is part of (what --max-batch-tokens counts)."""
        return self.tokens * self.branches * self.outputs


def _find_input_validation(pipeline: Any) -> Any | None:
    from diffserve.stages.input_validation import InputValidationStage

    for stage in getattr(pipeline, "stages", ()):
        if isinstance(stage, InputValidationStage):
            return stage
    return None


def request_cost(pipeline: Any, params: SamplingParams) -> RequestCost:
    """The cost of `params` on `pipeline`, before any model work (raises the family's InvalidRequestError).

    The family's input-validation stage is run on a throwaway request: it resolves the defaults and
    decides CFG exactly as the real run will, and costs nothing (no tensors)."""
    from diffserve.request import Req

    stage = _find_input_validation(pipeline)
    if stage is not None:
        probe = stage.forward(Req(params=dataclasses.replace(params, extra=dict(params.extra))))
        resolved, branches, step_cache = probe.params, 2 if probe.do_cfg else 1, probe.step_cache is not None
    else:
        resolved, branches, step_cache = pipeline.resolve_params(params), 1, False
    multiple = int(getattr(pipeline, "pixel_multiple", 16))
    frames, latent_frames = 1, 1
    if resolved.num_frames is not None:
        frames = int(resolved.num_frames)
        temporal = getattr(getattr(stage, "video", None), "temporal_factor", 1) or 1
        latent_frames = (frames - 1) // int(temporal) + 1
    area_tokens = (int(resolved.height) // multiple) * (int(resolved.width) // multiple)
    # Edit models append each input image's tokens, resized to about the output's area.
    condition_tokens = area_tokens * len(resolved.input_images or ())
    return RequestCost(
        tokens=area_tokens * latent_frames + condition_tokens,
        branches=branches,
        outputs=int(resolved.num_outputs_per_prompt),
        pixels=int(resolved.height) * int(resolved.width) * frames,
        step_cache=step_cache,
    )


@dataclass
class MemoryModel:
    """Coefficients of the per-request model and the engine's budget (see the module docstring)."""

    bytes_per_token: float
    bytes_per_pixel: float
    fixed_bytes: float
    decode_fixed_bytes: float
    #: What the running set may use: free memory after warm-up x --mem-fraction. None: unknown (the
    #: platform does not report free memory); then memory does not limit admission.
    budget_bytes: int | None
    #: "measured" (calibrated at warm-up) or "estimated" (from the DiT's width).
    source: str
    #: What a step cache holds per batch token: two hidden states of DiT width (residual, last signal).
    step_cache_bytes_per_token: float = 0.0

    def denoise_bytes(self, cost: RequestCost) -> float:
        cache = self.step_cache_bytes_per_token * cost.batch_tokens if cost.step_cache else 0.0
        return self.fixed_bytes + self.bytes_per_token * cost.batch_tokens + cache

    def decode_bytes(self, cost: RequestCost) -> float:
        return self.decode_fixed_bytes + self.bytes_per_pixel * cost.pixels * cost.outputs

    def estimate(self, cost: RequestCost) -> int:
        """Peak memory of this request running alone."""
        return int(self.denoise_bytes(cost) + self.decode_bytes(cost))

    def total(self, costs: Iterable[RequestCost]) -> int:
        """Peak memory of these requests running together: their denoising activations add up, their
        decodes run one at a time."""
        costs = list(costs)
        if not costs:
            return 0
        return int(sum(self.denoise_bytes(c) for c in costs) + max(self.decode_bytes(c) for c in costs))

    def fits(self, running: Iterable[RequestCost], cost: RequestCost) -> bool:
        return self.budget_bytes is None or self.total([*running, cost]) <= self.budget_bytes

    def check_alone(self, cost: RequestCost) -> None:
        """Raise RequestTooLargeError when `cost` does not fit even with nothing else running."""
        if self.budget_bytes is None:
            return
        need = self.estimate(cost)
        if need <= self.budget_bytes:
            return
        denoise, decode = self.denoise_bytes(cost), self.decode_bytes(cost)
        parts = [
            f"{cost.tokens} latent tokens x {cost.branches} CFG branch(es) x {cost.outputs} output(s) "
            f"-> {denoise / MB:.0f} MB denoising",
            f"{decode / MB:.0f} MB VAE decode",
        ]
        raise RequestTooLargeError(
            f"this request needs an estimated {need / MB:.0f} MB ({', '.join(parts)}) but the engine's memory "
            f"budget is {self.budget_bytes / MB:.0f} MB (free memory after warm-up x --mem-fraction); reduce "
            "size (width x height), num_frames / seconds, or n, or turn CFG off (no negative prompt / lower "
            "guidance), or start the server with a larger --mem-fraction"
        )

    def describe(self) -> dict[str, Any]:
        """For /server_info and the log."""
        return {
            "source": self.source,
            "bytes_per_token": round(self.bytes_per_token, 1),
            "bytes_per_pixel": round(self.bytes_per_pixel, 1),
            "fixed_mb": round(self.fixed_bytes / MB, 1),
            "decode_fixed_mb": round(self.decode_fixed_bytes / MB, 1),
            "budget_mb": None if self.budget_bytes is None else round(self.budget_bytes / MB, 1),
        }


def _budget(platform: Any, mem_fraction: float) -> int | None:
    available = platform.memory_info().available_bytes
    return None if available is None else int(available * mem_fraction)


def _dit_width(pipeline: Any) -> int:
    """The DiT's hidden width (heads x head_dim), from its config when it has one."""
    context = getattr(pipeline, "context", None)
    transformer = context.get_optional("transformer") if context is not None else None
    config = getattr(transformer, "config", None) or {}
    if isinstance(config, dict):
        heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
        if heads and head_dim:
            return int(heads) * int(head_dim)
    return int(getattr(transformer, "inner_dim", DEFAULT_DIT_WIDTH) or DEFAULT_DIT_WIDTH)


def _element_size(pipeline: Any) -> int:
    import torch

    context = getattr(pipeline, "context", None)
    dtype = getattr(context, "dtype", torch.float32)
    return torch.empty((), dtype=dtype).element_size()


def _step_cache_bytes_per_token(pipeline: Any) -> float:
    return float(2 * _dit_width(pipeline) * _element_size(pipeline))


def estimated_memory_model(pipeline: Any, platform: Any, mem_fraction: float) -> MemoryModel:
    """Coefficients from the DiT's width and dtype, no measurement (CPU, or warm-up turned off)."""
    element = _element_size(pipeline)
    return MemoryModel(
        bytes_per_token=float(ESTIMATED_WIDTHS_PER_TOKEN * _dit_width(pipeline) * element),
        bytes_per_pixel=float(ESTIMATED_BYTES_PER_PIXEL_PER_ELEMENT * element),
        fixed_bytes=float(ESTIMATED_FIXED_BYTES),
        decode_fixed_bytes=0.0,
        budget_bytes=_budget(platform, mem_fraction),
        source="estimated",
        step_cache_bytes_per_token=_step_cache_bytes_per_token(pipeline),
    )


def _empty_cache(platform: Any) -> None:
    """Give the allocator's cached blocks back, so free memory measured next counts them as free."""
    import torch

    runtime = getattr(torch, getattr(platform, "device_type", "cpu"), None)
    empty = getattr(runtime, "empty_cache", None)
    if callable(empty):
        with contextlib.suppress(Exception):  # a runtime without a cache to empty
            empty()


def _fit(xs: tuple[float, float], ys: tuple[float, float]) -> tuple[float, float]:
    """Slope and intercept through two points, both clamped at 0 (noise must not make them negative)."""
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0]) if xs[1] != xs[0] else 0.0
    slope = max(slope, 0.0)
    return slope, max(ys[0] - slope * xs[0], 0.0)


def calibrate_memory_model(
    pipeline: Any, platform: Any, probe_params: list[SamplingParams], mem_fraction: float
) -> MemoryModel:
    """Measure the model at warm-up (see the module docstring). `probe_params`: two one-step requests of
    different sizes. Falls back to `estimated_memory_model` where peaks cannot be measured."""
    from diffserve.request import Req

    if getattr(platform, "device_type", "cpu") == "cpu" or len(probe_params) < 2:
        return estimated_memory_model(pipeline, platform, mem_fraction)
    points = []
    for params in probe_params:
        cost = request_cost(pipeline, params)
        req = Req(params=params)
        platform.reset_peak_memory()
        base = platform.memory_info().peak_bytes
        if base is None:
            return estimated_memory_model(pipeline, platform, mem_fraction)
        req = pipeline.run_pre_denoise(req)
        while not req.is_denoised:
            pipeline.denoise_step([req])
        platform.synchronize()
        denoise_peak = platform.memory_info().peak_bytes - base
        platform.reset_peak_memory()
        base = platform.memory_info().peak_bytes
        pipeline.run_post_denoise(req)
        platform.synchronize()
        decode_peak = platform.memory_info().peak_bytes - base
        points.append((cost, denoise_peak, decode_peak))
        del req
    (c0, d0, v0), (c1, d1, v1) = points[0], points[-1]
    per_token, fixed = _fit((c0.batch_tokens, c1.batch_tokens), (d0, d1))
    per_pixel, decode_fixed = _fit((c0.pixels * c0.outputs, c1.pixels * c1.outputs), (v0, v1))
    _empty_cache(platform)
    model = MemoryModel(
        bytes_per_token=per_token * MEASURED_HEADROOM,
        bytes_per_pixel=per_pixel * MEASURED_HEADROOM,
        fixed_bytes=fixed * MEASURED_HEADROOM,
        decode_fixed_bytes=decode_fixed * MEASURED_HEADROOM,
        budget_bytes=_budget(platform, mem_fraction),
        source="measured",
        step_cache_bytes_per_token=_step_cache_bytes_per_token(pipeline),
    )
    logger.info(
        "Memory model calibrated: denoising %.0f / %.0f MB at %d / %d tokens, decoding %.0f / %.0f MB; %s",
        d0 / MB,
        d1 / MB,
        c0.batch_tokens,
        c1.batch_tokens,
        v0 / MB,
        v1 / MB,
        model.describe(),
    )
    return model
