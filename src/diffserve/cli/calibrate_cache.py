"""`diffserve calibrate-cache`: measure each approximate quality tier against the exact output (`high`)
and store its thresholds.

For each tier (medium, low, draft): the step-cache policy that computes the fewest steps in full while
the mean PSNR against the exact output over the calibration prompts stays `--margin-db` above the tier's
bar (35 / 30 / 25 dB), binary-searched over a threshold grid per `max_reuse_in_a_row` (a larger threshold
can only lower PSNR). Progress is logged with an estimate of the time left.

The speed-up is then timed with the exact and the cached runs interleaved (`--timing-rounds` rounds, each
prompt's exact and tier runs back to back, the order reversed every round), so a host whose load changes
during the run slows both alike; it is reported as the median of the per-prompt ratios with their spread
(min-max). The result, with its measurements, goes to `diffserve_step_cache.json` in the model folder."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.configs.quality import APPROXIMATE_TIERS, EXACT, PSNR_BARS, write_calibration
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import UserError

logger = logging.getLogger("diffserve.calibrate")

DEFAULT_PROMPTS = (
    "a photograph of a red fox sitting in fresh snow, morning light",
    "a watercolor painting of a lighthouse on a rocky coast at sunset",
    "a close-up of a bowl of ramen with a soft-boiled egg, studio lighting",
    "an isometric illustration of a small futuristic city with flying cars",
)
THRESHOLDS = (0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 0.8, 1.2, 1.6)
MAX_REUSE = (2, 3, 5)
DEFAULT_TIMING_ROUNDS = 3


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate-cache",
        help="measure the approximate quality tiers against the exact output; store their thresholds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_flags(p, "calibrate-cache")
    add = p.add_argument
    add("--prompt", action="append", default=None, help="calibration prompt (repeat; default: 4 built in)")
    add("--image", default=None, metavar="PATH", help="input image, for edit and image-to-video models")
    add("--num-inference-steps", type=int, default=None, help="steps (default: the family's, at least 20)")
    add("--height", type=int, default=None, help="height in pixels (default: the model's)")
    add("--width", type=int, default=None, help="width in pixels (default: the model's)")
    add("--num-frames", type=int, default=None, help="video models: frames (default: the model's)")
    add("--seed", type=int, default=0, help="seed of every calibration generation (default: 0)")
    add("--margin-db", type=float, default=1.0,
        help="mean PSNR kept above each tier's bar, for prompts unlike the calibration ones (default: 1)")  # fmt: skip
    add("--timing-rounds", type=int, default=DEFAULT_TIMING_ROUNDS, metavar="N",
        help=f"rounds of interleaved exact/cached runs timing speed-ups (default: {DEFAULT_TIMING_ROUNDS})")  # fmt: skip
    add("--dry-run", action="store_true", help="print the result without writing the file")
    p.set_defaults(handler=run)


@dataclass(frozen=True)
class Trial:
    """One candidate policy measured over every calibration prompt."""

    policy: StepCachePolicy
    psnr_db: list[float]
    steps_computed: list[int]

    @property
    def mean_psnr(self) -> float:
        return float(np.mean(self.psnr_db))

    @property
    def mean_steps(self) -> float:
        return float(np.mean(self.steps_computed))


class Progress:
    """Generations run so far and the wall time they took, for an estimate of the time the rest take."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._start = clock()
        self.done = 0

    def count(self, generations: int = 1) -> None:
        self.done += generations

    def describe(self, left: int, bound: bool = False) -> str:
        """'N generations in T, [at most] M left, ETA E' (the ETA from the mean time per generation so far).

        `bound`: `left` is an upper bound (a binary search may stop early), so the ETA is one too."""
        elapsed = self._clock() - self._start
        text = f"{self.done} generations in {_clock_time(elapsed)}, {'at most ' if bound else ''}{left} left"
        if self.done:
            text += f", ETA {'<= ' if bound else ''}{_clock_time(elapsed / self.done * left)}"
        return text


def _clock_time(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s"


def _pixels(out: Any) -> np.ndarray:
    """All of one generation's pixels as one array (video frames stacked), for PSNR."""
    if out.frames:
        return np.concatenate([np.asarray(f) for f in out.frames])
    return np.stack([np.asarray(image.convert("RGB")) for image in out.images])


def interleaved_speedups(
    run: Callable[[str, str], object],
    prompts: Sequence[str],
    tiers: Sequence[str],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
    after_round: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[float]], list[float]]:
    """Time `run(prompt, quality)` for the exact tier and each of `tiers`, interleaved.

    Per round and prompt the exact run and the tiers' runs go back to back (exact first in even rounds,
    last in odd ones), so a change in host load between rounds hits exact and cached runs alike. Returns
    tier -> the per-(round, prompt) speed-ups (exact seconds / tier seconds), and the exact runs' seconds.
    """
    speedups: dict[str, list[float]] = {tier: [] for tier in tiers}
    exact_seconds: list[float] = []
    for round_index in range(rounds):
        order = (EXACT, *tiers) if round_index % 2 == 0 else (*reversed(tiers), EXACT)
        for prompt in prompts:
            seconds = {}
            for quality in order:
                start = clock()
                run(prompt, quality)
                seconds[quality] = clock() - start
            exact_seconds.append(seconds[EXACT])
            for tier in tiers:
                speedups[tier].append(seconds[EXACT] / seconds[tier])
        if after_round is not None:
            after_round(round_index)
    return speedups, exact_seconds


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """Median, min and max of `values` (rounded to 0.01) and how many there are."""
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "samples": len(values),
    }


class Calibration:
    """The exact references, then candidate policies measured against them (each measured once)."""

    def __init__(
        self,
        generator: Any,
        prompts: list[str],
        request: dict[str, Any],
        rounds: int,
        searches: Sequence[tuple[StepCachePolicy, float]],
    ) -> None:
        """`searches`: the (template, floor_db) of each `best_for` call to come, for the estimate of the
        time left."""
        self.generator = generator
        self.prompts = prompts
        self.request = request
        self.num_steps: int = request["num_inference_steps"]
        self.trials: dict[StepCachePolicy, Trial] = {}
        self.progress = Progress()
        #: Generations the speed-up timing runs after the search (known up front, for the ETA).
        self.timing_generations = rounds * len(prompts) * (1 + len(APPROXIMATE_TIERS))
        last = len(THRESHOLDS) - 1
        #: Binary searches still to run or running: (template, max_reuse, floor_db, lo, hi).
        self._searches = [(t, m, floor, 0, last) for t, floor in searches for m in MAX_REUSE]
        self._generate(prompts[0], EXACT)  # warm-up: first calls allocate and fill caches
        self.reference = [_pixels(self._generate(prompt, EXACT)) for prompt in prompts]
        logger.info("Exact references done: %s", self.progress.describe(self.generations_left(), bound=True))

    def _generate(self, prompt: str, quality: str) -> Any:
        from diffserve.configs.sampling_params import SamplingParams

        out = self.generator.generate_from_params(
            SamplingParams(prompt=prompt, quality=quality, **self.request)
        )
        self.progress.count()
        return out

    def generations_left(self) -> int:
        """At most this many generations are left (a search may stop early or find its trials measured)."""
        trials = sum(self._unmeasured_on_path(*search) for search in self._searches)
        return trials * len(self.prompts) + self.timing_generations

    def _unmeasured_on_path(
        self, template: StepCachePolicy, max_reuse: int, floor_db: float, lo: int, hi: int
    ) -> int:
        """Most candidates not measured yet that a binary search over THRESHOLDS[lo..hi] can still meet
        (a measured one decides its way; an unmeasured one may go either way)."""
        if lo > hi:
            return 0
        mid = (lo + hi) // 2
        trial = self.trials.get(replace(template, threshold=THRESHOLDS[mid], max_reuse_in_a_row=max_reuse))
        if trial is not None:
            passes = trial.mean_psnr >= floor_db
            nxt = (mid + 1, hi) if passes else (lo, mid - 1)
            return self._unmeasured_on_path(template, max_reuse, floor_db, *nxt)
        return 1 + max(
            self._unmeasured_on_path(template, max_reuse, floor_db, lo, mid - 1),
            self._unmeasured_on_path(template, max_reuse, floor_db, mid + 1, hi),
        )

    def trial(self, policy: StepCachePolicy) -> Trial:
        """`policy` measured on every prompt as the `medium` tier (once; later calls reuse the result)."""
        from diffserve.testing.image_metrics import psnr_uint8

        if policy not in self.trials:
            self.generator.pipeline.use_step_cache_policies({"medium": policy})
            scores, steps = [], []
            for prompt, reference in zip(self.prompts, self.reference, strict=True):
                out = self._generate(prompt, "medium")
                scores.append(psnr_uint8(_pixels(out), reference))
                steps.append(out.steps_computed_in_full)
            trial = self.trials[policy] = Trial(policy, scores, steps)
            logger.info(
                "threshold %.3g, at most %d reused in a row: mean PSNR %.1f dB, %.1f of %d steps in full "
                "(%s)", policy.threshold, policy.max_reuse_in_a_row, trial.mean_psnr, trial.mean_steps,
                self.num_steps, self.progress.describe(self.generations_left(), bound=True),
            )  # fmt: skip
        return self.trials[policy]

    def best_for(self, floor_db: float, template: StepCachePolicy) -> Trial | None:
        """The trial with the fewest steps in full whose mean PSNR is at least `floor_db`."""
        passing = []
        for max_reuse in MAX_REUSE:
            lo, hi, best = 0, len(THRESHOLDS) - 1, None
            search = (template, max_reuse, floor_db, lo, hi)
            index = self._searches.index(search) if search in self._searches else None
            while lo <= hi:  # the largest threshold that still passes
                mid = (lo + hi) // 2
                if index is not None:  # where this search stands, for generations_left
                    self._searches[index] = (template, max_reuse, floor_db, lo, hi)
                policy = replace(template, threshold=THRESHOLDS[mid], max_reuse_in_a_row=max_reuse)
                trial = self.trial(policy)
                if trial.mean_psnr >= floor_db:
                    best, lo = trial, mid + 1
                else:
                    hi = mid - 1
            if index is not None:
                del self._searches[index]
            if best is not None:
                passing.append(best)
        return min(passing, key=lambda t: (t.mean_steps, -t.mean_psnr), default=None)

    def time_speedups(
        self, chosen: dict[str, StepCachePolicy], rounds: int
    ) -> tuple[dict[str, list[float]], list[float]]:
        """Speed-ups of the chosen policies, timed interleaved with exact runs (`interleaved_speedups`)."""
        self.generator.pipeline.use_step_cache_policies(chosen)
        self.timing_generations = rounds * len(self.prompts) * (1 + len(chosen))

        def after_round(index: int) -> None:
            self.timing_generations = (rounds - index - 1) * len(self.prompts) * (1 + len(chosen))
            logger.info(
                "Timing round %d of %d done: %s",
                index + 1,
                rounds,
                self.progress.describe(self.timing_generations),
            )

        return interleaved_speedups(
            self._generate, self.prompts, list(chosen), rounds, after_round=after_round
        )


#: The loggers `run` quiets while it generates, restored when it returns (the CLI may run in-process).
_QUIETED_LOGGERS = ("diffserve.stages", "diffserve.pipeline", "diffserve", logger.name)


def run(args: argparse.Namespace) -> int:
    levels = {name: logging.getLogger(name).level for name in _QUIETED_LOGGERS}
    try:
        return _calibrate(args)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _calibrate(args: argparse.Namespace) -> int:
    from diffserve.api import DiffGenerator
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.image_inputs import load_images

    if args.timing_rounds < 1:
        raise UserError(f"--timing-rounds must be >= 1, got {args.timing_rounds}")
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    images = load_images([Path(args.image)], param="--image") if args.image else None
    engine_args = engine_args_from(args)
    if not Path(engine_args.model_path).is_dir():  # the file is written next to model_index.json
        raise UserError(
            f"calibrate-cache writes its file into the model's folder: --model-path must be a local folder, "
            f"got {engine_args.model_path!r} (for a Hub model: hf download REPO --local-dir DIR)"
        )
    generator = DiffGenerator(engine_args, show_progress=False)
    # Dozens of generations follow: keep their per-stage logs out of the way, report per candidate.
    for name in ("diffserve.stages", "diffserve.pipeline", "diffserve"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logger.setLevel(logging.INFO)
    defaults = generator.pipeline.step_cache_policies
    if not defaults:
        raise UserError(
            f"{type(generator.pipeline).__name__} has no step cache: only {EXACT} (exact) is served"
        )
    names = ("height", "width", "num_frames", "seed", "num_inference_steps")
    request = {"input_images": images, **{name: getattr(args, name) for name in names}}
    if args.num_inference_steps is None:  # the family's default, but at least 20 (where caching pays)
        family_steps = generator.pipeline.resolve_params(SamplingParams(prompt=prompts[0], **request))
        request["num_inference_steps"] = max(20, family_steps.num_inference_steps)
    searches = {
        tier: (defaults.get(tier, StepCachePolicy(threshold=0.0)), PSNR_BARS[tier] + args.margin_db)
        for tier in APPROXIMATE_TIERS
    }
    calibration = Calibration(generator, prompts, request, args.timing_rounds, list(searches.values()))
    chosen: dict[str, Trial] = {}
    for tier, (template, floor_db) in searches.items():
        trial = calibration.best_for(floor_db, template)
        if trial is None:
            bar = f"{PSNR_BARS[tier]} + {args.margin_db} dB"
            raise UserError(f"no threshold keeps {tier} at {bar} on these prompts")
        chosen[tier] = trial
    policies = {tier: trial.policy for tier, trial in chosen.items()}
    logger.info(
        "Search done, timing the speed-ups: %s", calibration.progress.describe(calibration.generations_left())
    )
    speedups, exact_seconds = calibration.time_speedups(policies, args.timing_rounds)
    measurements = {
        "prompts": prompts,
        "num_inference_steps": calibration.num_steps,
        "margin_db": args.margin_db,
        "height": args.height,
        "width": args.width,
        "seed": args.seed,
        "timing_rounds": args.timing_rounds,
        "exact_seconds_per_prompt": round(statistics.median(exact_seconds), 4),
        "tiers": {
            tier: {
                "mean_psnr_db": round(trial.mean_psnr, 2),
                "min_psnr_db": round(min(trial.psnr_db), 2),
                "mean_steps_computed": trial.mean_steps,
                "speedup_vs_exact": spread(speedups[tier]),
            }
            for tier, trial in chosen.items()
        },
    }
    print(render(policies, measurements))
    if args.dry_run:
        return 0
    path = write_calibration(Path(engine_args.model_path), generator.family.name, policies, measurements)
    logger.info("Step-cache calibration written to %s", path)
    return 0


def render(chosen: dict[str, StepCachePolicy], measurements: dict[str, Any]) -> str:
    """The result as a Markdown table; the speed-up as median (min-max) over rounds x prompts."""
    steps = measurements["num_inference_steps"]
    lines = [
        f"Calibration over {len(measurements['prompts'])} prompts, {steps} steps; speed-up against the exact "
        f"output ({EXACT}): median (min-max) of {measurements['timing_rounds']} interleaved rounds x prompts:",
        "| tier | bar | threshold | max reuse in a row | mean PSNR | min PSNR | steps in full | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tier, policy in chosen.items():
        m = measurements["tiers"][tier]
        s = m["speedup_vs_exact"]
        lines.append(
            f"| {tier} | {PSNR_BARS[tier]:.0f} dB | {policy.threshold:g} | {policy.max_reuse_in_a_row} | "
            f"{m['mean_psnr_db']:.1f} dB | {m['min_psnr_db']:.1f} dB | {m['mean_steps_computed']:.1f} / {steps} | "
            f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}x) |"
        )
    return "\n".join(lines)
