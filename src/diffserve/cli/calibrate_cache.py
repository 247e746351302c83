"""`diffserve calibrate-cache`: measure each quality tier against lossless and store its thresholds.

For each tier (high, medium, low): the step-cache policy that computes the fewest steps in full while the
mean PSNR against lossless over the calibration prompts stays `--margin-db` above the tier's bar (35 /
30 / 25 dB), binary-searched over a threshold grid per `max_reuse_in_a_row` (a larger threshold can only
lower PSNR). The result, with its measurements, goes to `diffserve_step_cache.json` in the model folder."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.configs.quality import APPROXIMATE_TIERS, PSNR_BARS, write_calibration
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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate-cache",
        help="measure the quality tiers against lossless and store their step-cache thresholds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_flags(p)
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
    add("--dry-run", action="store_true", help="print the result without writing the file")
    add("--output-path", default="outputs", help=argparse.SUPPRESS)
    p.set_defaults(handler=run)


@dataclass(frozen=True)
class Trial:
    """One candidate policy measured over every calibration prompt."""

    policy: StepCachePolicy
    psnr_db: list[float]
    steps_computed: list[int]
    seconds: float

    @property
    def mean_psnr(self) -> float:
        return float(np.mean(self.psnr_db))

    @property
    def mean_steps(self) -> float:
        return float(np.mean(self.steps_computed))


def _pixels(out) -> np.ndarray:
    """All of one generation's pixels as one array (video frames stacked), for PSNR."""
    if out.frames:
        return np.concatenate([np.asarray(f) for f in out.frames])
    return np.stack([np.asarray(image.convert("RGB")) for image in out.images])


class Calibration:
    def __init__(self, generator, prompts: list[str], request: dict) -> None:
        self.generator = generator
        self.prompts = prompts
        self.request = request
        self.trials: dict[tuple[float, int], Trial] = {}
        self._generate(prompts[0], "lossless")  # warm-up, untimed: first calls allocate and fill caches
        start = time.perf_counter()
        self.reference = [_pixels(self._generate(prompt, "lossless")) for prompt in prompts]
        self.lossless_seconds = time.perf_counter() - start
        self.num_steps: int = request["num_inference_steps"]

    def _generate(self, prompt: str, quality: str):
        from diffserve.configs.sampling_params import SamplingParams

        return self.generator.generate_from_params(
            SamplingParams(prompt=prompt, quality=quality, **self.request)
        )

    def trial(self, threshold: float, max_reuse: int, template: StepCachePolicy) -> Trial:
        from diffserve.testing.image_metrics import psnr_uint8

        key = (threshold, max_reuse)
        if key not in self.trials:
            policy = dataclasses.replace(template, threshold=threshold, max_reuse_in_a_row=max_reuse)
            self.generator.pipeline.use_step_cache_policies({"medium": policy})
            scores, steps, start = [], [], time.perf_counter()
            for prompt, reference in zip(self.prompts, self.reference, strict=True):
                out = self._generate(prompt, "medium")
                scores.append(psnr_uint8(_pixels(out), reference))
                steps.append(out.steps_computed_in_full)
            trial = Trial(policy, scores, steps, time.perf_counter() - start)
            logger.info(
                "threshold %.3g, at most %d reused in a row: mean PSNR %.1f dB, %.1f of %d steps in full",
                threshold, max_reuse, trial.mean_psnr, trial.mean_steps, self.num_steps,
            )  # fmt: skip
            self.trials[key] = trial
        return self.trials[key]

    def best_for(self, floor_db: float, template: StepCachePolicy) -> Trial | None:
        """The trial with the fewest steps in full whose mean PSNR is at least `floor_db`."""
        passing = []
        for max_reuse in MAX_REUSE:
            lo, hi, best = 0, len(THRESHOLDS) - 1, None
            while lo <= hi:  # the largest threshold that still passes
                mid = (lo + hi) // 2
                trial = self.trial(THRESHOLDS[mid], max_reuse, template)
                if trial.mean_psnr >= floor_db:
                    best, lo = trial, mid + 1
                else:
                    hi = mid - 1
            if best is not None:
                passing.append(best)
        return min(passing, key=lambda t: (t.mean_steps, -t.mean_psnr), default=None)


def run(args: argparse.Namespace) -> int:
    from diffserve.api import DiffGenerator
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.image_inputs import load_images

    prompts = args.prompt or list(DEFAULT_PROMPTS)
    images = load_images([Path(args.image)], param="--image") if args.image else None
    engine_args = engine_args_from(args)
    generator = DiffGenerator(engine_args, show_progress=False)
    # Dozens of generations follow: keep their per-stage logs out of the way, report per candidate.
    for name in ("diffserve.stages", "diffserve.pipeline", "diffserve"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logger.setLevel(logging.INFO)
    defaults = generator.pipeline.step_cache_policies
    if not defaults:
        raise UserError(f"{type(generator.pipeline).__name__} has no step cache: only lossless is served")
    names = ("height", "width", "num_frames", "seed", "num_inference_steps")
    request = {"input_images": images, **{name: getattr(args, name) for name in names}}
    if args.num_inference_steps is None:  # the family's default, but at least 20 (where caching pays)
        family_steps = generator.pipeline.resolve_params(SamplingParams(prompt=prompts[0], **request))
        request["num_inference_steps"] = max(20, family_steps.num_inference_steps)
    calibration = Calibration(generator, prompts, request)
    chosen: dict[str, StepCachePolicy] = {}
    measurements = {
        "prompts": prompts,
        "num_inference_steps": calibration.num_steps,
        "margin_db": args.margin_db,
        "height": args.height,
        "width": args.width,
        "seed": args.seed,
        "lossless_seconds_per_prompt": calibration.lossless_seconds / len(prompts),
        "tiers": {},
    }
    for tier in APPROXIMATE_TIERS:
        template = defaults.get(tier, StepCachePolicy(threshold=0.0))
        trial = calibration.best_for(PSNR_BARS[tier] + args.margin_db, template)
        if trial is None:
            bar = f"{PSNR_BARS[tier]} + {args.margin_db} dB"
            raise UserError(f"no threshold keeps {tier} at {bar} on these prompts")
        chosen[tier] = trial.policy
        measurements["tiers"][tier] = {
            "mean_psnr_db": round(trial.mean_psnr, 2),
            "min_psnr_db": round(min(trial.psnr_db), 2),
            "mean_steps_computed": trial.mean_steps,
            "speedup_vs_lossless": round(calibration.lossless_seconds / trial.seconds, 2),
        }
    print(render(chosen, measurements))
    if args.dry_run:
        return 0
    path = write_calibration(Path(engine_args.model_path), generator.family.name, chosen, measurements)
    logger.info("Step-cache calibration written to %s", path)
    return 0


def render(chosen: dict[str, StepCachePolicy], measurements: dict) -> str:
    steps = measurements["num_inference_steps"]
    lines = [
        f"Calibration over {len(measurements['prompts'])} prompts, {steps} steps:",
        "| tier | bar | threshold | max reuse in a row | mean PSNR | min PSNR | steps in full | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tier, policy in chosen.items():
        m = measurements["tiers"][tier]
        lines.append(
            f"| {tier} | {PSNR_BARS[tier]:.0f} dB | {policy.threshold:g} | {policy.max_reuse_in_a_row} | "
            f"{m['mean_psnr_db']:.1f} dB | {m['min_psnr_db']:.1f} dB | {m['mean_steps_computed']:.1f} / {steps} | "
            f"{m['speedup_vs_lossless']:.2f}x |"
        )
    return "\n".join(lines)
