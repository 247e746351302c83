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

Calibration (runtime/calibration.py): on platforms with a resettable peak counter (CUDA, ROCm, XPU,
...) two one-step generations of different sizes run through the engine at warm-up; the peak above the
resident baseline of the denoising phase and of the decoding phase at the two sizes gives the two slopes
and intercepts (`measured_memory_model`: a straight-line fit, 10% headroom). On CPU the process's peak
RSS cannot be reset, so the coefficients come from the DiT's width instead (`estimated_memory_model`):
generous, and against a budget of the available RAM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from diffserve.errors import UserError
from diffserve.platforms.base import Platform
from diffserve.request import Req
from diffserve.runtime.contract import PipelineFacts

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


def request_cost(facts: PipelineFacts, req: Req) -> RequestCost:
    """The cost of a validated request (`EnginePipeline.validate` resolved its params and decided CFG
    and its quality tier), before any model work."""
    params = req.params
    if params.height is None or params.width is None:
        raise ValueError("request_cost needs a validated request (height and width resolved)")
    multiple = facts.pixel_multiple
    frames, latent_frames = 1, 1
    if facts.makes_video and params.num_frames is not None:
        frames = int(params.num_frames)
        latent_frames = (frames - 1) // facts.temporal_factor + 1
    area_tokens = (int(params.height) // multiple) * (int(params.width) // multiple)
    # Edit models append each input image's tokens, resized to about the output's area.
    condition_tokens = area_tokens * len(params.input_images or ())
    return RequestCost(
        tokens=area_tokens * latent_frames + condition_tokens,
        branches=2 if req.do_cfg else 1,
        outputs=int(params.num_outputs_per_prompt),
        pixels=int(params.height) * int(params.width) * frames,
        step_cache=req.step_cache is not None,
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


def memory_budget(platform: Platform, mem_fraction: float) -> int | None:
    """What the running set may use: the platform's available memory now x `mem_fraction`."""
    available = platform.memory_info().available_bytes
    return None if available is None else int(available * mem_fraction)


def _element_size(facts: PipelineFacts) -> int:
    return torch.empty((), dtype=facts.dtype).element_size()


def _step_cache_bytes_per_token(facts: PipelineFacts) -> float:
    return float(2 * facts.dit_width * _element_size(facts))


def estimated_memory_model(facts: PipelineFacts, platform: Platform, mem_fraction: float) -> MemoryModel:
    """Coefficients from the DiT's width and dtype, no measurement (CPU, or warm-up turned off)."""
    element = _element_size(facts)
    return MemoryModel(
        bytes_per_token=float(ESTIMATED_WIDTHS_PER_TOKEN * facts.dit_width * element),
        bytes_per_pixel=float(ESTIMATED_BYTES_PER_PIXEL_PER_ELEMENT * element),
        fixed_bytes=float(ESTIMATED_FIXED_BYTES),
        decode_fixed_bytes=0.0,
        budget_bytes=memory_budget(platform, mem_fraction),
        source="estimated",
        step_cache_bytes_per_token=_step_cache_bytes_per_token(facts),
    )


def fit_line(xs: tuple[float, float], ys: tuple[float, float]) -> tuple[float, float]:
    """Slope and intercept through two points, both clamped at 0 (noise must not make them negative)."""
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0]) if xs[1] != xs[0] else 0.0
    slope = max(slope, 0.0)
    return slope, max(ys[0] - slope * xs[0], 0.0)


@dataclass(frozen=True)
class PhasePeaks:
    """One calibration request: its cost and the peak memory above the resident baseline of its
    denoising phase and of its decoding phase."""

    cost: RequestCost
    denoise_bytes: int
    decode_bytes: int


def measured_memory_model(
    facts: PipelineFacts, platform: Platform, points: list[PhasePeaks], mem_fraction: float
) -> MemoryModel:
    """The straight-line fit through two calibration requests of different sizes (runtime/calibration.py
    runs them through the engine), with `MEASURED_HEADROOM`."""
    first, last = points[0], points[-1]
    per_token, fixed = fit_line(
        (first.cost.batch_tokens, last.cost.batch_tokens), (first.denoise_bytes, last.denoise_bytes)
    )
    per_pixel, decode_fixed = fit_line(
        (first.cost.pixels * first.cost.outputs, last.cost.pixels * last.cost.outputs),
        (first.decode_bytes, last.decode_bytes),
    )
    model = MemoryModel(
        bytes_per_token=per_token * MEASURED_HEADROOM,
        bytes_per_pixel=per_pixel * MEASURED_HEADROOM,
        fixed_bytes=fixed * MEASURED_HEADROOM,
        decode_fixed_bytes=decode_fixed * MEASURED_HEADROOM,
        budget_bytes=memory_budget(platform, mem_fraction),
        source="measured",
        step_cache_bytes_per_token=_step_cache_bytes_per_token(facts),
    )
    logger.info(
        "Memory model calibrated: denoising %.0f / %.0f MB at %d / %d tokens, decoding %.0f / %.0f MB; %s",
        first.denoise_bytes / MB, last.denoise_bytes / MB, first.cost.batch_tokens, last.cost.batch_tokens,
        first.decode_bytes / MB, last.decode_bytes / MB, model.describe(),
    )  # fmt: skip
    return model
