"""How much memory a request needs and how much the engine may use:

    denoise(r) = fixed + per_token * tokens(r) * branches(r) * outputs(r)  [+ its step cache]
    decode(r)  = decode_fixed + per_pixel * pixels(r) * outputs(r)

Running requests denoise together but decode one at a time, so a running set needs `sum(denoise) +
max(decode)`, within free memory after warm-up x --mem-fraction. The coefficients are measured at
warm-up (runtime/calibration.py) where the platform has a peak counter, else estimated (CPU)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diffserve.errors import UserError
from diffserve.platforms.base import Platform
from diffserve.request import Req
from diffserve.runtime.contract import PipelineFacts

logger = logging.getLogger("diffserve.runtime")

MB = 2**20
MEASURED_HEADROOM = 1.1  # peaks vary a little from run to run (allocator rounding)
CALIBRATION_SIDES = (256, 512)  # pixels, rounded to the model's granularity
#: The CPU estimate: activations per latent token in DiT widths (hidden states, q/k/v, the 4x MLP, ...),
#: per decoded pixel (the VAE's last blocks: 128 channels at full resolution), and per request.
ESTIMATED_WIDTHS_PER_TOKEN = 24
ESTIMATED_BYTES_PER_PIXEL_PER_ELEMENT = 4 * 128
ESTIMATED_FIXED_BYTES = 64 * MB


class RequestTooLargeError(UserError):
    """The request alone needs more memory than the engine may use (the server answers 413)."""

    param = "size"


@dataclass(frozen=True)
class RequestCost:
    """What a request occupies while it runs: DiT latent `tokens` of one output and branch (input images'
    included), CFG `branches` (2: the negative branch runs in the same DiT batch), `outputs` (`n`), decoded
    `pixels` of one output (times its frames), and whether it holds a `step_cache` (approximate tier)."""

    tokens: int
    branches: int
    outputs: int
    pixels: int
    step_cache: bool = False

    @property
    def batch_tokens(self) -> int:
        """Tokens this request adds to every DiT batch it is part of (what --max-batch-tokens counts)."""
        return self.tokens * self.branches * self.outputs


def request_cost(facts: PipelineFacts, req: Req) -> RequestCost:
    """The cost of a validated request (params resolved, CFG and quality tier decided)."""
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
    """Coefficients of the per-request model (the module docstring) and the engine's budget."""

    bytes_per_token: float
    bytes_per_pixel: float
    fixed_bytes: float
    decode_fixed_bytes: float
    budget_bytes: int | None  # what the running set may use; None (free memory unknown): no limit
    source: str  # "measured" (calibrated at warm-up) or "estimated" (from the DiT's width)
    # Per batch token: two hidden states of DiT width (residual, last signal).
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
        """Peak memory of these requests running together."""
        costs = list(costs)
        if not costs:
            return 0
        return int(sum(self.denoise_bytes(c) for c in costs) + max(self.decode_bytes(c) for c in costs))

    def fits(self, running: Iterable[RequestCost], cost: RequestCost) -> bool:
        return self.budget_bytes is None or self.total([*running, cost]) <= self.budget_bytes

    def check_alone(self, cost: RequestCost) -> None:
        """Raise RequestTooLargeError when `cost` does not fit even with nothing else running."""
        if self.budget_bytes is None or (need := self.estimate(cost)) <= self.budget_bytes:
            return
        raise RequestTooLargeError(
            f"this request needs an estimated {need / MB:.0f} MB ({cost.tokens} latent tokens x {cost.branches} "
            f"CFG branch(es) x {cost.outputs} output(s) -> {self.denoise_bytes(cost) / MB:.0f} MB denoising, "
            f"{self.decode_bytes(cost) / MB:.0f} MB VAE decode) but the engine's memory "
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


def _step_cache_bytes_per_token(facts: PipelineFacts) -> float:
    return float(2 * facts.dit_width * facts.dtype.itemsize)


def estimated_memory_model(facts: PipelineFacts, platform: Platform, mem_fraction: float) -> MemoryModel:
    """Coefficients from the DiT's width and dtype, no measurement (CPU, or warm-up turned off)."""
    element = facts.dtype.itemsize
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
    slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]) if xs[1] != xs[0] else 0.0, 0.0)
    return slope, max(ys[0] - slope * xs[0], 0.0)


@dataclass(frozen=True)
class PhasePeaks:
    """One calibration request: its cost and each phase's peak above the resident baseline."""

    cost: RequestCost
    denoise_bytes: int
    decode_bytes: int


def measured_memory_model(
    facts: PipelineFacts, platform: Platform, points: list[PhasePeaks], mem_fraction: float
) -> MemoryModel:
    """The straight-line fit through two calibration requests of different sizes, with headroom."""
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
