"""`diffserve calibrate-cache`: choose each approximate quality tier's preset for one model: the cache method
and settings that compute the fewest DiT blocks while the tier keeps its PSNR against the exact output.

For each tier (medium, low, draft) every candidate ladder (`configs/tier_candidates.py`: the original step
cache, DBCache with and without TaylorSeer, TeaCache, TaylorSeer, SCM masks, MagCache with ratios measured
here, as far as the model's DiT runs them; `--methods` narrows it) is binary-searched for its most
aggressive rung whose mean PSNR over the calibration prompts stays `--margin-db` above the tier's bar
(35 / 30 / 25 dB); the tier takes the rung, over all ladders, with the fewest DiT blocks computed (ties:
the higher PSNR). Blocks, not seconds, decide: they do not depend on the host's load. `--also-steps`
makes a candidate keep the bar at other step counts too (a preset runs at whatever step count a request
asks for: MagCache, say, can hold 35 dB at 20 steps and fall under 30 at 4). Progress is logged with an
estimate of the time left.

The speed-up is then timed with the exact and the cached runs interleaved (`--timing-rounds` rounds, each
prompt's exact and tier runs back to back, the order reversed every round), so a host whose load changes
during the run slows both alike; it is reported as the median of the per-prompt ratios with their spread
(min-max). The presets, with their measurements (every candidate measured, and the best original step
cache per tier for comparison), go to `diffserve_step_cache.json` in the model folder."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.configs.quality import (
    APPROXIMATE_TIERS,
    EXACT,
    PSNR_BARS,
    TierPreset,
    describe_preset,
    preset_to_dict,
    write_calibration,
)
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.configs.tier_candidates import (
    CANDIDATE_METHODS,
    Ladder,
    magcache_ladders,
    method_ladders,
    step_cache_ladders,
)
from diffserve.errors import UserError

logger = logging.getLogger("diffserve.calibrate")

DEFAULT_PROMPTS = (
    "a photograph of a red fox sitting in fresh snow, morning light",
    "a watercolor painting of a lighthouse on a rocky coast at sunset",
    "a close-up of a bowl of ramen with a soft-boiled egg, studio lighting",
    "an isometric illustration of a small futuristic city with flying cars",
)
DEFAULT_TIMING_ROUNDS = 3


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate-cache",
        help="choose each approximate quality tier's cache method and settings for a model; store them",
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
    add("--also-steps", default=None, metavar="N1,N2",
        help="other step counts each tier must also keep its bar at (no margin), e.g. a distilled model's "
        "4,8: a candidate failing there is skipped (default: none)")  # fmt: skip
    add("--methods", default=None, metavar="M1,M2",
        help=f"candidate methods, comma-separated, of {', '.join(CANDIDATE_METHODS)} (default: stepcache and "
        "every method the model's DiT runs)")  # fmt: skip
    add("--dry-run", action="store_true", help="print the result without writing the file")
    p.set_defaults(handler=run)


@dataclass(frozen=True)
class Trial:
    """One candidate preset measured over every calibration prompt."""

    preset: TierPreset
    psnr_db: list[float]
    steps_computed: list[int]
    blocks_computed: list[int]

    @property
    def mean_psnr(self) -> float:
        return float(np.mean(self.psnr_db))

    @property
    def mean_steps(self) -> float:
        return float(np.mean(self.steps_computed))

    @property
    def mean_blocks(self) -> float:
        return float(np.mean(self.blocks_computed))

    def summary(self) -> dict[str, Any]:
        """What the calibration file records of it."""
        return {
            "preset": preset_to_dict(self.preset),
            "mean_psnr_db": round(self.mean_psnr, 2),
            "min_psnr_db": round(min(self.psnr_db), 2),
            "mean_blocks_computed": self.mean_blocks,
            "mean_steps_computed": self.mean_steps,
        }


def fastest(trials: Sequence[Trial]) -> Trial | None:
    """The trial with the fewest DiT blocks computed (ties: the higher PSNR, then the earlier one)."""
    return min(trials, key=lambda t: (t.mean_blocks, -t.mean_psnr), default=None)


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


#: A binary search of one ladder for one bar, where it stands: (ladder, floor_db, lo, hi).
Search = tuple[Ladder, float, int, int]


class Calibration:
    """The exact references, then candidate presets measured against them (each measured once)."""

    def __init__(
        self,
        generator: Any,
        prompts: list[str],
        request: dict[str, Any],
        rounds: int,
        searches: Sequence[tuple[Sequence[Ladder], float]],
        also_steps: Sequence[int] = (),
        margin_db: float = 0.0,
    ) -> None:
        """`searches`: the (ladders, floor_db) of each `best_for` call to come, for the estimate of the
        time left. `also_steps`: other step counts a passing candidate must also keep the bar at (its floor
        less `margin_db`), so that a tier holds at the step counts it serves, not only the calibrated one."""
        self.generator = generator
        self.prompts = prompts
        self.request = request
        self.num_steps: int = request["num_inference_steps"]
        self.also_steps = tuple(also_steps)
        self.margin_db = margin_db
        self.trials: dict[TierPreset, Trial] = {}
        #: (preset, step count) -> its mean PSNR there (-inf: the preset cannot run that step count).
        self.psnr_at: dict[tuple[TierPreset, int], float] = {}
        self.progress = Progress()
        #: Generations the speed-up timing runs after the search (known up front, for the ETA).
        self.timing_generations = rounds * len(prompts) * (1 + len(APPROXIMATE_TIERS))
        #: Binary searches still to run or running.
        self._searches: list[Search] = [
            (ladder, floor, 0, len(ladder.presets) - 1) for ladders, floor in searches for ladder in ladders
        ]
        self._generate(prompts[0], EXACT)  # warm-up: first calls allocate and fill caches
        self.reference = [_pixels(self._generate(prompt, EXACT)) for prompt in prompts]
        self.also_reference = {
            steps: [_pixels(self._generate(prompt, EXACT, steps=steps)) for prompt in prompts]
            for steps in self.also_steps
        }
        logger.info("Exact references done: %s", self.progress.describe(self.generations_left(), bound=True))

    def _generate(self, prompt: str, quality: str, cache: Any = None, steps: int | None = None) -> Any:
        """One generation at `quality` (and `steps`, default the calibration's); the exact one also
        without the engine's `--cache-default`."""
        from diffserve.configs.cache_settings import NoCache
        from diffserve.configs.sampling_params import SamplingParams

        if quality == EXACT and cache is None:
            cache = NoCache()
        request = self.request if steps is None else {**self.request, "num_inference_steps": steps}
        out = self.generator.generate_from_params(
            SamplingParams(prompt=prompt, quality=quality, cache=cache, **request)
        )
        self.progress.count()
        return out

    def add_searches(self, searches: Sequence[tuple[Sequence[Ladder], float]]) -> None:
        """Searches decided after the start (the magcache ladder, once its ratios are measured)."""
        for ladders, floor in searches:
            self._searches += [(ladder, floor, 0, len(ladder.presets) - 1) for ladder in ladders]

    def measure_mag_ratios(self) -> tuple[float, ...]:
        """The model's MagCache ratios at the calibration's step count: per step, the mean over the
        calibration prompts of the measured ratio (`magcache_calibrate`, which reuses nothing)."""
        from diffserve.configs.cache_settings import MagCacheSettings

        measured = []
        for prompt in self.prompts:
            out = self._generate(prompt, EXACT, MagCacheSettings(magcache_calibrate=True))
            measured.append(out.cache["measured_mag_ratios"])
        ratios = tuple(round(float(r), 5) for r in np.mean(np.asarray(measured), axis=0))
        logger.info("MagCache ratios measured over %d prompts: %s", len(self.prompts), list(ratios))
        return ratios

    def generations_left(self) -> int:
        """At most this many generations are left (a search may stop early or find its trials measured)."""
        return sum(self._unmeasured_on_path(*search) for search in self._searches) + self.timing_generations

    def _unmeasured_on_path(self, ladder: Ladder, floor_db: float, lo: int, hi: int) -> int:
        """Most generations a binary search over `ladder.presets[lo..hi]` can still run: a decided
        candidate goes its way; an undecided one costs what deciding it takes and may go either way."""
        if lo > hi:
            return 0
        mid = (lo + hi) // 2
        preset = ladder.presets[mid]
        decided = self._decided(preset, floor_db)
        if decided is not None:
            nxt = (mid + 1, hi) if decided else (lo, mid - 1)
            return self._unmeasured_on_path(ladder, floor_db, *nxt)
        unknown_steps = sum((preset, s) not in self.psnr_at for s in self.also_steps)
        cost = len(self.prompts) * ((preset not in self.trials) + unknown_steps)
        return cost + max(
            self._unmeasured_on_path(ladder, floor_db, lo, mid - 1),
            self._unmeasured_on_path(ladder, floor_db, mid + 1, hi),
        )

    def _decided(self, preset: TierPreset, floor_db: float) -> bool | None:
        """Whether `preset` passes `floor_db` (and the bar at the other step counts), None while unknown."""
        trial = self.trials.get(preset)
        if trial is None:
            return None
        if trial.mean_psnr < floor_db:
            return False
        scores = [self.psnr_at.get((preset, s)) for s in self.also_steps]
        if any(score is not None and score < floor_db - self.margin_db for score in scores):
            return False
        return None if None in scores else True

    def passes(self, preset: TierPreset, floor_db: float) -> bool:
        """`preset` keeps `floor_db` at the calibration's step count and, at each of `also_steps`, the bar
        (the floor less the margin), measuring what it must."""
        if self.trial(preset).mean_psnr < floor_db:
            return False
        return all(self.measure_at(preset, steps) >= floor_db - self.margin_db for steps in self.also_steps)

    def measure_at(self, preset: TierPreset, steps: int) -> float:
        """`preset`'s mean PSNR at `steps` steps (once); -inf when it cannot run that many (a named step
        mask without a form there: the tier would refuse such requests)."""
        from diffserve.errors import InvalidRequestError
        from diffserve.testing.image_metrics import psnr_uint8

        key = (preset, steps)
        if key not in self.psnr_at:
            self.generator.pipeline.use_step_cache_policies({"medium": preset})
            try:
                outs = [self._generate(prompt, "medium", steps=steps) for prompt in self.prompts]
                scores = [
                    psnr_uint8(_pixels(o), r) for o, r in zip(outs, self.also_reference[steps], strict=True)
                ]
                self.psnr_at[key] = float(np.mean(scores))
            except InvalidRequestError as exc:
                logger.info("candidate %s cannot run %d steps: %s", describe_preset(preset), steps, exc)
                self.psnr_at[key] = float("-inf")
            logger.info(
                "candidate %s at %d steps: mean PSNR %.1f dB",
                describe_preset(preset),
                steps,
                self.psnr_at[key],
            )
        return self.psnr_at[key]

    def trial(self, preset: TierPreset) -> Trial:
        """`preset` measured on every prompt as the `medium` tier (once; later calls reuse the result)."""
        from diffserve.testing.image_metrics import psnr_uint8

        if preset not in self.trials:
            self.generator.pipeline.use_step_cache_policies({"medium": preset})
            scores, steps, blocks = [], [], []
            for prompt, reference in zip(self.prompts, self.reference, strict=True):
                out = self._generate(prompt, "medium")
                scores.append(psnr_uint8(_pixels(out), reference))
                steps.append(out.steps_computed_in_full)
                blocks.append(out.cache["blocks_computed"])
            trial = self.trials[preset] = Trial(preset, scores, steps, blocks)
            logger.info(
                "candidate %s: mean PSNR %.1f dB, %.1f blocks computed, %.1f of %d steps in full (%s)",
                describe_preset(preset), trial.mean_psnr, trial.mean_blocks, trial.mean_steps, self.num_steps,
                self.progress.describe(self.generations_left(), bound=True),
            )  # fmt: skip
        return self.trials[preset]

    def search(self, ladder: Ladder, floor_db: float) -> Trial | None:
        """The last rung of `ladder` that `passes` `floor_db` (binary search: PSNR is taken to fall along a
        ladder), None when even its first fails."""
        lo, hi, best = 0, len(ladder.presets) - 1, None
        key: Search = (ladder, floor_db, lo, hi)
        index = self._searches.index(key) if key in self._searches else None
        while lo <= hi:
            mid = (lo + hi) // 2
            if index is not None:  # where this search stands, for generations_left
                self._searches[index] = (ladder, floor_db, lo, hi)
            if self.passes(ladder.presets[mid], floor_db):
                best, lo = self.trials[ladder.presets[mid]], mid + 1
            else:
                hi = mid - 1
        if index is not None:
            del self._searches[index]
        return best

    def best_for(self, floor_db: float, ladders: Sequence[Ladder]) -> tuple[Trial | None, dict[str, Trial]]:
        """(the passing rung with the fewest blocks computed over all `ladders`, each ladder's passing rung)."""
        passing = {ladder.name: self.search(ladder, floor_db) for ladder in ladders}
        found = {name: trial for name, trial in passing.items() if trial is not None}
        return fastest(list(found.values())), found

    def time_speedups(
        self, chosen: dict[str, TierPreset], rounds: int
    ) -> tuple[dict[str, list[float]], list[float]]:
        """Speed-ups of the chosen presets, timed interleaved with exact runs (`interleaved_speedups`)."""
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


def candidate_methods(requested: str | None, dit_methods: frozenset[str], family: str) -> list[str]:
    """The methods to search: `--methods` (each checked against the candidates and the DiT), else the
    original step cache and every candidate method the DiT runs."""
    if requested is None:
        return [m for m in CANDIDATE_METHODS if m == "stepcache" or m in dit_methods]
    names = [name.strip() for name in requested.split(",") if name.strip()]
    for name in names:
        if name not in CANDIDATE_METHODS:
            raise UserError(
                f"--methods: unknown method {name!r}; candidates are {', '.join(CANDIDATE_METHODS)}"
            )
        if name != "stepcache" and name not in dit_methods:
            runs = ", ".join(sorted(dit_methods)) or "none"
            raise UserError(
                f"--methods: {family}'s DiT does not run {name!r} (it runs: {runs}, and stepcache)"
            )
    if not names:
        raise UserError("--methods: name at least one method")
    return names


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
    pipeline = generator.pipeline
    rule = pipeline.cache_rule
    if not pipeline.step_cache_policies:  # a family without tiers (Wan 2.2 A14B: the experts switch)
        raise UserError(f"{type(pipeline).__name__} has no step cache: only {EXACT} (exact) is served")
    methods = candidate_methods(args.methods, rule.methods, type(pipeline).__name__)
    names = ("height", "width", "num_frames", "seed", "num_inference_steps")
    request = {"input_images": images, **{name: getattr(args, name) for name in names}}
    if args.num_inference_steps is None:  # the family's default, but at least 20 (where caching pays)
        family_steps = pipeline.resolve_params(SamplingParams(prompt=prompts[0], **request))
        request["num_inference_steps"] = max(20, family_steps.num_inference_steps)
    floors = {tier: PSNR_BARS[tier] + args.margin_db for tier in APPROXIMATE_TIERS}
    ladders = {tier: tier_ladders(tier, methods, pipeline.step_cache_policies) for tier in APPROXIMATE_TIERS}
    also_steps = parse_steps(args.also_steps)
    calibration = Calibration(
        generator,
        prompts,
        request,
        args.timing_rounds,
        [(ladders[t], floors[t]) for t in APPROXIMATE_TIERS],
        also_steps,
        args.margin_db,
    )
    if "magcache" in methods:  # its ladders need the model's ratios: measured on these prompts, the family's
        magcache = magcache_ladders(calibration.measure_mag_ratios(), rule.mag_ratios is not None)
        calibration.add_searches([(magcache, floors[t]) for t in APPROXIMATE_TIERS])
        ladders = {tier: [*found, *magcache] for tier, found in ladders.items()}
    chosen: dict[str, Trial] = {}
    stepcache_best: dict[str, Trial | None] = {}
    for tier in APPROXIMATE_TIERS:
        trial, passing = calibration.best_for(floors[tier], ladders[tier])
        if trial is None:
            bar = f"{PSNR_BARS[tier]} + {args.margin_db} dB"
            raise UserError(f"no candidate of {', '.join(methods)} keeps {tier} at {bar} on these prompts")
        chosen[tier] = trial
        stepcache_best[tier] = fastest([t for t in passing.values() if isinstance(t.preset, StepCachePolicy)])
    presets = {tier: trial.preset for tier, trial in chosen.items()}
    logger.info(
        "Search done, timing the speed-ups: %s", calibration.progress.describe(calibration.generations_left())
    )
    speedups, exact_seconds = calibration.time_speedups(presets, args.timing_rounds)
    measurements = {
        "prompts": prompts,
        "num_inference_steps": calibration.num_steps,
        "margin_db": args.margin_db,
        "height": args.height,
        "width": args.width,
        "seed": args.seed,
        "timing_rounds": args.timing_rounds,
        "methods": methods,
        "also_steps": list(also_steps),
        "blocks_per_generation": rule.num_blocks * calibration.num_steps,
        "exact_seconds_per_prompt": round(statistics.median(exact_seconds), 4),
        "tiers": {
            tier: {
                **trial.summary(),
                "mean_psnr_db_at_steps": {
                    str(steps): round(calibration.psnr_at[(trial.preset, steps)], 2) for steps in also_steps
                },
                "speedup_vs_exact": spread(speedups[tier]),
                "best_stepcache": None if stepcache_best[tier] is None else stepcache_best[tier].summary(),
            }
            for tier, trial in chosen.items()
        },
        "candidates": [trial.summary() for trial in calibration.trials.values()],
    }
    print(render(presets, measurements))
    if args.dry_run:
        return 0
    path = write_calibration(Path(engine_args.model_path), generator.family.name, presets, measurements)
    logger.info("Quality-tier presets written to %s", path)
    return 0


def parse_steps(text: str | None) -> list[int]:
    """`--also-steps`' step counts (UserError naming the flag for anything but positive integers)."""
    if text is None:
        return []
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--also-steps: expected step counts such as 4,8, got {text!r}") from None
    if not steps or any(n < 1 for n in steps):
        raise UserError(f"--also-steps: expected positive step counts such as 4,8, got {text!r}")
    return steps


def tier_ladders(tier: str, methods: Sequence[str], defaults: dict[str, TierPreset]) -> list[Ladder]:
    """A tier's candidate ladders but magcache's: the family's default preset for the tier (when its
    method is among `methods`: a calibrated tier then never computes more blocks than the default did at
    the same bar), the original step cache's from the family's template for the tier (its default where
    that is a step cache), then the other methods'."""
    default = defaults.get(tier)
    found: list[Ladder] = []
    if default is not None and default.method in methods:
        found.append(Ladder("the family's default", (default,)))
    if "stepcache" in methods:
        template = default if isinstance(default, StepCachePolicy) else StepCachePolicy(threshold=0.0)
        found += step_cache_ladders(template)
    return found + method_ladders(set(methods) - {"magcache"})


def render(chosen: dict[str, TierPreset], measurements: dict[str, Any]) -> str:
    """The result as a Markdown table: each tier's preset, its PSNR, the DiT blocks it computed (and the
    best original step cache's, for comparison) and its speed-up as median (min-max) over rounds x prompts."""
    steps = measurements["num_inference_steps"]
    total = measurements["blocks_per_generation"]
    lines = [
        f"Calibration over {len(measurements['prompts'])} prompts, {steps} steps; speed-up against the exact "
        f"output ({EXACT}): median (min-max) of {measurements['timing_rounds']} interleaved rounds x prompts:",
        "| tier | bar | preset | mean PSNR | min PSNR | blocks computed | stepcache's best: blocks (PSNR) | "
        "steps in full | speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tier, preset in chosen.items():
        m = measurements["tiers"][tier]
        s = m["speedup_vs_exact"]
        old = m["best_stepcache"]
        baseline = "-" if old is None else f"{old['mean_blocks_computed']:.1f} ({old['mean_psnr_db']:.1f} dB)"
        lines.append(
            f"| {tier} | {PSNR_BARS[tier]:.0f} dB | {describe_preset(preset)} | {m['mean_psnr_db']:.1f} dB | "
            f"{m['min_psnr_db']:.1f} dB | {m['mean_blocks_computed']:.1f} / {total} | {baseline} | "
            f"{m['mean_steps_computed']:.1f} / {steps} | {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}x) |"
        )
    return "\n".join(lines)
