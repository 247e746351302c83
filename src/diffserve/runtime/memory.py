"""How much memory a request needs and how much the engine may use:

    denoise(r) = fixed + per_token * tokens(r) * branches(r) * outputs(r)  [+ its step cache]
    decode(r)  = decode_fixed + outputs(r) * (per_pixel * chunk_pixels(r) + per_output_pixel * pixels(r))

`chunk_pixels` are the pixels one VAE decoder call makes: a video VAE decodes one latent frame at a time
with a causal cache (`models/vaes/causal3d_blocks.py`), so its activations scale with one latent frame's
output frames (the temporal factor, 4 for Wan) at full size, never with the clip's length; an image is a
one-frame chunk. `pixels` are every frame of the clip: the decoded video and its float / uint8 copies
(`stages/video_vae_decoding.py`) are held whole, `per_output_pixel` bytes each (0 for images, whose
buffers the per-pixel term covers).

Running requests denoise together but are admitted as if they decode one at a time (a second decode starts
beside one only when both fit, and nothing is admitted while two run: `Engine._may_decode_beside`), so a
running set needs `sum(denoise) + max(decode) + swap`, within free memory after warm-up x --mem-fraction.
`swap` is the weights that move in for a stage with component offload (`WeightResidency`, offload/): the
largest offloaded component, counted once (one is on the device at a time); the weights resident on the
device are already out of the free memory the budget is measured from. The coefficients are measured at
warm-up (runtime/calibration.py) where the platform has a resettable peak counter (the CPU's is VmHWM on
Linux), else estimated; with offloaded components they are estimated (a swap inside a measured phase would
hide its activations).

VAE tiling (`models/vaes/tiling.py`): a tiled decode's decoder call makes one tile, so `chunk_pixels` is
one tile's area (at most the frame's) times the chunk's frames, and the decoded tiles, overlaps included,
are held until they are stitched (`TILE_HOLD_BYTES_PER_PIXEL` per pixel of the clip). With `--vae-tiling`
every decode is costed tiled. Without it, on one device, a request is admitted on the cheaper of its untiled
and tiled decode, and at decode time (`MemoryModel.decode_tiled`) its decode is tiled when the untiled one,
with the running requests' denoising, would not fit the budget; over several ranks the row-split decode
(`distributed/parallel_vae.py`) already divides the decode and nothing is tiled automatically."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from diffserve.errors import UserError
from diffserve.platforms.base import Platform
from diffserve.request import Req
from diffserve.runtime.contract import PipelineFacts
from diffserve.vae_tiling import SupportsTiling, tile_area

logger = logging.getLogger("diffserve.runtime")

MB = 2**20
MEASURED_HEADROOM = 1.1  # peaks vary a little from run to run (allocator rounding)
CALIBRATION_SIDES = (256, 512)  # pixels, rounded to the model's granularity
#: On the CPU the probes run at CPU speed at every server start: smaller sides, as the line's fit takes
#: the fixed overhead (measured within 0.9-3x of the peak on a tiny Wan: tests/e2e/test_video_admission_cpu.py).
CPU_CALIBRATION_SIDES = (64, 128)
#: The estimate without measurement: activations per latent token in DiT widths (hidden states, q/k/v,
#: the 4x MLP, ...), per decoded pixel of one decoder call (the VAE's last blocks: 128 channels at full
#: resolution; measured ~1.8-2.1 KB per pixel-frame for Wan 2.1's VAE in fp32 on the CPU, im2col
#: included), and per request.
ESTIMATED_WIDTHS_PER_TOKEN = 24
ESTIMATED_BYTES_PER_PIXEL_PER_ELEMENT = 4 * 128
ESTIMATED_FIXED_BYTES = 64 * MB
#: Per denoising step, host-side: the schedule's sigmas and timesteps (float64 arrays and their tensors)
#: and each step's recorded time; measured ~22 bytes per step on a request of 10^8 steps, rounded up.
BYTES_PER_STEP = 64
RGB = 3  # channels of a decoded frame
FLOAT32_BYTES = 4
#: What a tiled decode holds per pixel of the clip beyond one tile's activations, counted in float32: every
#: decoded tile until they are blended (about (tile / stride)^2 = 1.8 copies with Diffusers' default tiles),
#: the stitched output and its clamped copy, and (images, whose buffers the untiled per-pixel term covers)
#: the float copies of the conversion to 8 bits.
TILE_HOLD_BYTES_PER_PIXEL = 6 * RGB * FLOAT32_BYTES


class RequestTooLargeError(UserError):
    """The request alone needs more memory than the engine may use (the server answers 413)."""

    param = "size"


@dataclass(frozen=True)
class RequestCost:
    """What a request occupies while it runs: `height` x `width` pixels (DiT tokens of `pixel_multiple`
    squares) of `frames` output frames (1 for an image; `temporal_factor` frames per latent frame after
    the first), `condition_images` input images (each about the output's area in tokens), CFG
    `branches` (2: the negative branch runs in the same DiT batch), `outputs` (`n`), and whether it holds
    a `step_cache` (approximate tier)."""

    height: int
    width: int
    pixel_multiple: int
    branches: int
    outputs: int
    frames: int = 1
    temporal_factor: int = 1
    condition_images: int = 0
    step_cache: bool = False
    #: With a step cache: the hidden states per token it keeps (`RequestCache.kept_states`; the tiers' 2).
    cache_states: int = 2
    steps: int = 0  # denoising steps: the schedule and per-step records grow with them
    #: The (height, width) asked, where the family generates at another size (`height` x `width`: SANA's
    #: resolution bins); None: generated as asked. Lowering the size asked need not lower the bin, so the
    #: memory message's advice names no size for such a request.
    asked_size: tuple[int, int] | None = None

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // self.temporal_factor + 1

    @property
    def tokens(self) -> int:
        """DiT latent tokens of one output and branch, input images' included."""
        area = (self.height // self.pixel_multiple) * (self.width // self.pixel_multiple)
        return area * (self.latent_frames + self.condition_images)

    @property
    def batch_tokens(self) -> int:
        """Tokens this request adds to every DiT batch it is part of (what --max-batch-tokens counts)."""
        return self.tokens * self.branches * self.outputs

    @property
    def frame_pixels(self) -> int:
        return self.height * self.width

    @property
    def pixels(self) -> int:
        """Decoded pixels of one output, every frame."""
        return self.frame_pixels * self.frames

    @property
    def chunk_frames(self) -> int:
        """Output frames one VAE decoder call makes at most (one latent frame's)."""
        return min(self.frames, self.temporal_factor)

    @property
    def chunk_pixels(self) -> int:
        """Decoded pixels of one output in one VAE decoder call: what the decoder's activations scale with."""
        return self.frame_pixels * self.chunk_frames


def request_cost(facts: PipelineFacts, req: Req) -> RequestCost:
    """The cost of a validated request (params resolved, CFG and quality tier decided)."""
    params = req.params
    if params.height is None or params.width is None:
        raise ValueError("request_cost needs a validated request (height and width resolved)")
    # The size the family generates at (SANA's resolution bins), which its tokens and decode scale with,
    # not the size asked for (the output is resized back to it after decoding).
    height, width = req.generated.size or (params.height, params.width)
    video = facts.makes_video and params.num_frames is not None
    # Several latent images per output (an image family's `Req.generated.images`) cost as frames of a video
    # without temporal compression: each its own tokens, each decoded.
    return RequestCost(
        height=int(height),
        width=int(width),
        pixel_multiple=facts.pixel_multiple,
        branches=2 if req.do_cfg else 1,
        outputs=int(params.num_outputs_per_prompt),
        frames=int(params.num_frames) if video else max(int(req.generated.images), 1),
        temporal_factor=facts.temporal_factor if video else 1,
        # Edit models append each input image's tokens, resized to about the output's area.
        condition_images=len(params.input_images or ()),
        step_cache=req.step_cache is not None,
        cache_states=2 if req.step_cache is None else req.step_cache.kept_states,
        steps=int(params.num_inference_steps or 0),
        asked_size=None
        if (height, width) == (params.height, params.width)
        else (params.height, params.width),
    )


@dataclass(frozen=True)
class WeightResidency:
    """The model's weights as the device holds them (`offload.weight_residency`): `resident_bytes` stay on
    the device; `swap_bytes` is the most that moves in for one stage (the largest offloaded component, or
    a layerwise DiT's window of blocks) while the resident weights stay; `moved_in_bytes` were on the
    device when this was read (an offloaded component stays there until another component is used)."""

    resident_bytes: int = 0
    swap_bytes: int = 0
    moved_in_bytes: int = 0


#: No offload: the weights are resident (their bytes unknown here: the budget is measured without them).
NO_OFFLOAD = WeightResidency()


def output_buffer_bytes_per_pixel(dtype: torch.dtype, on_host: bool) -> float:
    """Bytes per decoded video pixel (all 3 channels) that `VideoVaeDecodingStage` holds for the whole clip
    at its peak, where the platform's memory counter sees them. On the device: the decoded clip in the
    model's dtype, its clamped copy, and a float32 copy when the dtype is narrower (the frames list and
    `torch.cat` hold two model-dtype copies earlier, which is less). On the host (CPU platform): the
    clip, its clamped float32 array (the same tensor when the model runs in float32), and the `* 255` and
    `.round()` arrays numpy makes before the uint8 cast."""
    item = dtype.itemsize
    narrower = item < FLOAT32_BYTES
    if on_host:
        per_channel = item + (item if narrower else 0) + 3 * FLOAT32_BYTES
    else:
        per_channel = max(3 * item, 2 * item + (FLOAT32_BYTES if narrower else 0))
    return float(RGB * per_channel)


@dataclass
class MemoryModel:
    """Coefficients of the per-request model (the module docstring) and the engine's budget."""

    bytes_per_token: float
    bytes_per_pixel: float  # per decoded pixel of one decoder call (`RequestCost.chunk_pixels`)
    fixed_bytes: float
    decode_fixed_bytes: float
    budget_bytes: int | None  # what the running set may use; None (free memory unknown): no limit
    source: str  # "measured" (calibrated at warm-up) or "estimated" (from the DiT's width)
    # Per batch token: two hidden states of DiT width (residual, last signal).
    step_cache_bytes_per_token: float = 0.0
    # Per decoded pixel of the whole clip (`RequestCost.pixels`): the frames' buffers; 0 for images.
    bytes_per_output_pixel: float = 0.0
    # The weights: resident, and what moves in for a stage (counted once per running set).
    weights: WeightResidency = NO_OFFLOAD
    # VAE tiling: output pixels of one tile; None: the decode is never tiled (the VAE cannot, or several
    # ranks without --vae-tiling). `vae_tiling_forced` (--vae-tiling): every decode is tiled.
    vae_tile_pixels: int | None = None
    vae_tiling_forced: bool = False
    # Device bytes kept out of `budget_bytes` for LoRA adapters loaded later (`--max-lora-memory`).
    lora_reserved_bytes: int = 0

    def denoise_bytes(self, cost: RequestCost) -> float:
        per_state = self.step_cache_bytes_per_token / 2  # `_step_cache_bytes_per_token`: two hidden states
        cache = per_state * cost.cache_states * cost.batch_tokens if cost.step_cache else 0.0
        schedule = BYTES_PER_STEP * cost.steps
        return self.fixed_bytes + self.bytes_per_token * cost.batch_tokens + cache + schedule

    def decode_activation_bytes(self, cost: RequestCost, tiled: bool | None = None) -> float:
        """The VAE decoder's working memory: one decoder call's pixels, for every output at once; `tiled`
        (None: as `decode_bytes` costs it) one tile's, plus the tiles held for blending."""
        if tiled is None:
            tiled = self._costs_tiled(cost)
        if not tiled or self.vae_tile_pixels is None:
            return self.decode_fixed_bytes + self.bytes_per_pixel * cost.chunk_pixels * cost.outputs
        tile_pixels = min(cost.frame_pixels, self.vae_tile_pixels) * cost.chunk_frames
        held = TILE_HOLD_BYTES_PER_PIXEL * cost.pixels
        return self.decode_fixed_bytes + (self.bytes_per_pixel * tile_pixels + held) * cost.outputs

    def output_buffer_bytes(self, cost: RequestCost) -> float:
        """The decoded frames of every output, held whole."""
        return self.bytes_per_output_pixel * cost.pixels * cost.outputs

    def decode_bytes(self, cost: RequestCost, tiled: bool | None = None) -> float:
        return self.decode_activation_bytes(cost, tiled) + self.output_buffer_bytes(cost)

    def _costs_tiled(self, cost: RequestCost) -> bool:
        """Whether admission costs this request's decode tiled: always with --vae-tiling; automatic tiling
        costs the cheaper of the two (the decode is tiled when the untiled one would not fit)."""
        if self.vae_tile_pixels is None:
            return False
        if self.vae_tiling_forced:
            return True
        return self.decode_activation_bytes(cost, True) < self.decode_activation_bytes(cost, False)

    @property
    def vae_tiling_mode(self) -> str:
        """ "on" (--vae-tiling), "auto" (tiled when the untiled decode would not fit) or "off"."""
        if self.vae_tile_pixels is None:
            return "off"
        return "on" if self.vae_tiling_forced else "auto"

    def decode_tiled(self, running: Iterable[RequestCost], cost: RequestCost) -> bool:
        """At decode time: tile this request's decode? Always with --vae-tiling; automatically when its
        untiled decode plus the other running requests' denoising would not fit the budget (and tiling is
        cheaper); never when the decode cannot be tiled."""
        if self.vae_tile_pixels is None:
            return False
        if self.vae_tiling_forced:
            return True
        if self.budget_bytes is None or not self._costs_tiled(cost):
            return False
        others = sum(self.denoise_bytes(c) for c in running)
        untiled = others + self.denoise_bytes(cost) + self.decode_bytes(cost, False) + self.weights.swap_bytes
        return untiled > self.budget_bytes

    def estimate(self, cost: RequestCost) -> int:
        """Peak memory of this request running alone (with the offloaded weights it moves in)."""
        return int(self.denoise_bytes(cost) + self.decode_bytes(cost) + self.weights.swap_bytes)

    def total(self, costs: Iterable[RequestCost]) -> int:
        """Peak memory of these requests running together: one offloaded component is in at a time."""
        costs = list(costs)
        if not costs:
            return 0
        activations = sum(self.denoise_bytes(c) for c in costs) + max(self.decode_bytes(c) for c in costs)
        return int(activations + self.weights.swap_bytes)

    def fits(self, running: Iterable[RequestCost], cost: RequestCost) -> bool:
        return self.budget_bytes is None or self.total([*running, cost]) <= self.budget_bytes

    def fits_alone(self, cost: RequestCost) -> bool:
        return self.budget_bytes is None or self.estimate(cost) <= self.budget_bytes

    def check_alone(self, cost: RequestCost) -> None:
        """Raise RequestTooLargeError when `cost` does not fit even with nothing else running; its advice
        names only changes that make this estimate fit when followed (`fitting_changes`)."""
        if self.fits_alone(cost):
            return
        assert self.budget_bytes is not None
        need = self.estimate(cost)
        decode = (
            f"{self.decode_bytes(cost) / MB:.0f} MB VAE decode ({self.decode_activation_bytes(cost) / MB:.0f} MB "
            f"decoding {cost.chunk_frames} frame(s) at a time{' in VAE tiles' if self._costs_tiled(cost) else ''}"
        )
        if self.output_buffer_bytes(cost):
            decode += f" + {self.output_buffer_bytes(cost) / MB:.0f} MB holding the {cost.frames} frames"
        if self.weights.swap_bytes:
            decode += f"; {self.weights.swap_bytes / MB:.0f} MB offloaded weights moving in for a stage"
        changes = fitting_changes(self, cost)
        advice = (
            "; to fit, " + ", or ".join(changes) + ", or give the engine a larger --mem-fraction"
            if changes
            else "; even the smallest such request does not fit: give the engine a larger --mem-fraction "
            "or on a machine with more free memory"
        )
        generated = ""
        if cost.asked_size is not None:
            generated = (
                f"{cost.asked_size[1]}x{cost.asked_size[0]} asked, generated at {cost.width}x{cost.height} "
                "(the family's resolution bin): "
            )
        raise RequestTooLargeError(
            f"this request needs an estimated {need / MB:.0f} MB ({generated}{cost.tokens} latent tokens x {cost.branches} "
            f"CFG branch(es) x {cost.outputs} output(s) -> {self.denoise_bytes(cost) / MB:.0f} MB denoising, "
            f"{decode}) but the engine's memory budget is {self.budget_bytes / MB:.0f} MB (free memory after "
            f"warm-up x --mem-fraction){advice}"
        )

    def describe(self) -> dict[str, object]:
        """For /server_info and the log."""
        return {
            "source": self.source,
            "bytes_per_token": round(self.bytes_per_token, 1),
            "bytes_per_pixel": round(self.bytes_per_pixel, 1),
            "bytes_per_output_pixel": round(self.bytes_per_output_pixel, 1),
            "fixed_mb": round(self.fixed_bytes / MB, 1),
            "decode_fixed_mb": round(self.decode_fixed_bytes / MB, 1),
            "budget_mb": None if self.budget_bytes is None else round(self.budget_bytes / MB, 1),
            "resident_weights_mb": round(self.weights.resident_bytes / MB, 1),
            "offload_swap_mb": round(self.weights.swap_bytes / MB, 1),
            "vae_tiling": self.vae_tiling_mode,
            # budget_mb is what requests may use: free memory after warm-up x --mem-fraction, less this.
            "lora_reserved_mb": round(self.lora_reserved_bytes / MB, 1),
        }


def _largest_fitting(
    model: MemoryModel, count: int, candidate: Callable[[int], RequestCost]
) -> RequestCost | None:
    """The largest of `candidate(1) < ... < candidate(count)` that fits alone, by bisection: a candidate's
    cost grows with its index, so this takes about log2(count) probes however large the request was."""
    low, high = 0, count  # candidate(low) fits (or low == 0: none tried fits), candidate(high + 1) does not
    while low < high:
        middle = (low + high + 1) // 2
        if model.fits_alone(candidate(middle)):
            low = middle
        else:
            high = middle - 1
    return candidate(low) if low > 0 else None


def _scaled_size(cost: RequestCost, scale: float) -> RequestCost:
    """`cost` at `scale` times its sides (aspect kept), rounded down to its pixel multiple (at least one)."""
    m = cost.pixel_multiple
    return replace(
        cost, height=max(m, int(cost.height * scale) // m * m), width=max(m, int(cost.width * scale) // m * m)
    )


def fitting_changes(model: MemoryModel, cost: RequestCost) -> list[str]:
    """The single changes to `cost` that fit alone, each as advice with the number to use: the largest
    size (aspect kept; the longer side whole pixel multiples below the request's), frame count (whole
    temporal steps below) and `n` that fit, and CFG off. Candidate k of each is the k-th smallest."""
    m, longer = cost.pixel_multiple, max(cost.height, cost.width)
    tf = cost.temporal_factor
    options: list[tuple[Callable[[RequestCost], str], int, Callable[[int], RequestCost]]] = []
    if cost.asked_size is None:  # a binned size does not follow the size asked
        options.append(
            (
                lambda c: f"reduce size (width x height) to at most {c.width}x{c.height}",
                (longer - 1) // m,
                lambda k: _scaled_size(cost, (longer - ((longer - 1) // m - k + 1) * m) / longer),
            )
        )
    options += [
        (
            lambda c: f"num_frames / seconds to at most {c.frames} frames",
            (cost.frames - 1) // tf,
            lambda k: replace(cost, frames=cost.frames - ((cost.frames - 1) // tf - k + 1) * tf),
        ),
        (lambda c: f"n to at most {c.outputs}", cost.outputs - 1, lambda k: replace(cost, outputs=k)),
        (
            lambda c: "turn CFG off (no negative prompt / lower guidance)",
            1 if cost.branches > 1 else 0,
            lambda _: replace(cost, branches=1),
        ),
    ]
    changes = []
    for advice, count, candidate in options:
        if (fitting := _largest_fitting(model, count, candidate)) is not None:
            changes.append(advice(fitting))
    return changes


def memory_budget(
    platform: Platform, mem_fraction: float, weights: WeightResidency = NO_OFFLOAD
) -> int | None:
    """What the running set may use: the platform's available memory now x `mem_fraction`, counted as if
    the offloaded components were out (those in now leave when another component is used; the one that
    moves in for a stage is `MemoryModel.total`'s `swap`)."""
    available = platform.memory_info().available_bytes
    return None if available is None else int((available + weights.moved_in_bytes) * mem_fraction)


def _step_cache_bytes_per_token(facts: PipelineFacts) -> float:
    return float(2 * facts.dit_width * facts.dtype.itemsize)


def _output_buffer_bytes_per_pixel(facts: PipelineFacts, platform: Platform) -> float:
    """What `output_buffer_bytes_per_pixel` gives for this pipeline on this platform; 0 for images."""
    if not facts.makes_video:
        return 0.0
    return output_buffer_bytes_per_pixel(facts.dtype, on_host=platform.device_type == "cpu")


def estimated_memory_model(
    facts: PipelineFacts, platform: Platform, mem_fraction: float, weights: WeightResidency = NO_OFFLOAD
) -> MemoryModel:
    """Coefficients from the DiT's width and dtype, no measurement (no peak counter, warm-up turned off, or
    offloaded weights moving inside the measured phases); `weights` as `offload.weight_residency` reads them."""
    element = facts.dtype.itemsize
    return MemoryModel(
        bytes_per_token=float(ESTIMATED_WIDTHS_PER_TOKEN * facts.dit_width * element),
        bytes_per_pixel=float(ESTIMATED_BYTES_PER_PIXEL_PER_ELEMENT * element),
        fixed_bytes=float(ESTIMATED_FIXED_BYTES),
        decode_fixed_bytes=0.0,
        budget_bytes=memory_budget(platform, mem_fraction, weights),
        source="estimated",
        step_cache_bytes_per_token=_step_cache_bytes_per_token(facts),
        bytes_per_output_pixel=_output_buffer_bytes_per_pixel(facts, platform),
        weights=weights,
    )


def fit_line(
    xs: tuple[float, float], ys: tuple[float, float], one_point_slope: float | None = None
) -> tuple[float, float]:
    """Slope and intercept through two points, both clamped at 0 (noise must not make them negative).
    Two points at the same x (a family that generates both calibration probes at one size: HiDream-I1's
    area rule) measure no slope: `one_point_slope` (the estimate's) is taken, through the higher point;
    without it they are refused (ValueError), not fitted with a zero slope that would cost every request
    the same."""
    if xs[1] == xs[0]:
        if one_point_slope is None:
            raise ValueError(f"two points at the same x ({xs[0]}) fit no line: pass one_point_slope")
        slope = max(one_point_slope, 0.0)
        return slope, max(max(ys) - slope * xs[0], 0.0)
    slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
    return slope, max(ys[0] - slope * xs[0], 0.0)


def fit_bounding_line(
    xs: tuple[float, float], ys: tuple[float, float], noisy: bool, one_point_slope: float | None = None
) -> tuple[float, float]:
    """`fit_line`, with a `noisy` counter's slope raised to at least the larger point's `y / x` (the line
    through zero and that point). A small probe that reads high (allocator pages counted) tilts the
    two-point line under the larger requests it must bound; with a non-negative fixed term, the line
    through zero and the larger probe is above the true line for every larger request."""
    slope, intercept = fit_line(xs, ys, one_point_slope)
    if noisy and xs[1] > 0:
        slope = max(slope, max(ys[1], ys[0] if xs[0] == xs[1] else 0.0) / xs[1])
    return slope, intercept


@dataclass(frozen=True)
class PhasePeaks:
    """One calibration request: its cost and each phase's peak above the resident baseline."""

    cost: RequestCost
    denoise_bytes: int
    decode_bytes: int


def measured_memory_model(
    facts: PipelineFacts,
    platform: Platform,
    points: list[PhasePeaks],
    mem_fraction: float,
    weights: WeightResidency = NO_OFFLOAD,
) -> MemoryModel:
    """The straight-line fit through two calibration requests of different sizes, with headroom. The
    frames' buffer is known from the code (`output_buffer_bytes_per_pixel`); the decode line is fitted to
    what remains, against the pixels of one decoder call.

    With offloaded components (`weights.swap_bytes`) the phases' peaks hold weights moving in and out
    (a text encoder's copy can be the whole denoising phase's peak, hiding the DiT's activations), so the
    fit would be wrong: the estimated model is used instead (logged)."""
    if weights.swap_bytes:
        logger.info(
            "Memory model estimated: offloaded weights (%.0f MB at most) move in during the calibration "
            "requests' phases, so their peaks do not measure activations",
            weights.swap_bytes / MB,
        )
        return estimated_memory_model(facts, platform, mem_fraction, weights)
    first, last = points[0], points[-1]
    # Where the family generates both probes at one size (HiDream-I1's area rule renders every request at
    # the default area), the points give the cost at that size only: the per-token and per-pixel slopes
    # (what `n` and CFG scale with) are the estimate's, and the fixed terms what the point measured beyond.
    estimate = estimated_memory_model(facts, platform, mem_fraction, weights)
    one_point = first.cost.batch_tokens == last.cost.batch_tokens
    if one_point:
        logger.info(
            "Memory calibration: both probes ran at %d tokens (the family generates them at one size): "
            "one-point fit, with the estimate's per-token and per-pixel slopes",
            first.cost.batch_tokens,
        )
    per_token, fixed = fit_line(
        (first.cost.batch_tokens, last.cost.batch_tokens),
        (first.denoise_bytes, last.denoise_bytes),
        estimate.bytes_per_token,
    )
    per_output_pixel = _output_buffer_bytes_per_pixel(facts, platform)

    def activations(point: PhasePeaks) -> float:
        return point.decode_bytes - per_output_pixel * point.cost.pixels * point.cost.outputs

    # Decoding's activations are per pixel by nature (convolutions over the frames), so on a noisy counter
    # its slope may be bounded by the line through zero; denoising keeps the two-point fit (on a small
    # model its fixed part, the text states and the step's own tensors, would make that bound far too high).
    per_pixel, decode_fixed = fit_bounding_line(
        (first.cost.chunk_pixels * first.cost.outputs, last.cost.chunk_pixels * last.cost.outputs),
        (activations(first), activations(last)),
        platform.peak_counter_is_noisy(),
        estimate.bytes_per_pixel,
    )
    model = MemoryModel(
        bytes_per_token=per_token * MEASURED_HEADROOM,
        bytes_per_pixel=per_pixel * MEASURED_HEADROOM,
        fixed_bytes=fixed * MEASURED_HEADROOM,
        decode_fixed_bytes=decode_fixed * MEASURED_HEADROOM,
        budget_bytes=memory_budget(platform, mem_fraction, weights),
        source="measured (one size)" if one_point else "measured",
        step_cache_bytes_per_token=_step_cache_bytes_per_token(facts),
        bytes_per_output_pixel=per_output_pixel,
        weights=weights,
    )
    logger.info(
        "Memory model calibrated: denoising %.0f / %.0f MB at %d / %d tokens, decoding %.0f / %.0f MB; %s",
        first.denoise_bytes / MB, last.denoise_bytes / MB, first.cost.batch_tokens, last.cost.batch_tokens,
        first.decode_bytes / MB, last.decode_bytes / MB, model.describe(),
    )  # fmt: skip
    return model


def with_vae_tiling(model: MemoryModel, vae: object | None, forced: bool, single_device: bool) -> MemoryModel:
    """`model` costing the decode of `vae` tiled: always with `forced` (--vae-tiling), automatically
    (`MemoryModel.decode_tiled`) on a single device; unchanged for a VAE without tiling."""
    if not isinstance(vae, SupportsTiling) or not (forced or single_device):
        return model
    return replace(model, vae_tile_pixels=tile_area(vae), vae_tiling_forced=forced)
