"""The candidate presets `diffserve calibrate-cache` measures for the quality tiers, as ladders.

A ladder is one kind of preset (a method with its other settings fixed) at rising aggressiveness: a
larger threshold, a longer interval, a sparser mask. Along a ladder the PSNR against the exact output can
only be expected to fall and the DiT blocks computed to fall with it, so the calibration binary-searches
each ladder for its last rung that meets a tier's bar, then serves the tier with the rung, over all
ladders, that computes the fewest blocks (`cli/calibrate_cache.py`).

The grid is small on purpose (each rung costs a generation per calibration prompt) and covers each method
at the settings its authors recommend:

    stepcache   diffserve's original step cache at its thresholds, at most 2, 3 or 5 steps reused in a row,
                from the tier's own template (its first and last full steps): the tiers' method before
                presets, so a calibrated tier never computes more blocks than it did at the same bar.
    dbcache     cache-dit's F1B0 (the first block decides, every other block is reused), two warm-up steps,
                at most 3 steps reused in a row, at rising `residual_diff_threshold`, then 5 in a row at
                the top threshold; with and without TaylorSeer (order 1, cache-dit's recommendation).
    teacache    rising `rel_l1_thresh`, the family's coefficients (or the raw change where it has none).
    taylorseer  every block every `cache_interval` steps after two warm-up steps, order 1 and 2.
    scm         cache-dit's named step masks from slow to ultra (static: a 0 always reuses), with and
                without TaylorSeer.
    magcache    rising `magcache_thresh`, at most 4 steps reused in a row (then 6 and 10 at the top
                threshold), with the model's magnitude ratios measured by the calibration on its own
                prompts (`magcache_calibrate`), and with the family's recorded ratios where it has them.
    easycache   rising `reuse_threshold`, its warm-up and cool-down at ComfyUI's defaults.
    seacache    rising `threshold`, at most 2 steps reused in a row (then 3 and 5 at the top threshold),
                order 1 (the residual extrapolated), diffusers' other defaults.

No torch here: the grid is configuration.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from diffserve.configs.cache_settings import (
    DBCacheSettings,
    EasyCacheSettings,
    MagCacheSettings,
    ScmSettings,
    SeaCacheSettings,
    TaylorSeerSettings,
    TeaCacheSettings,
)
from diffserve.configs.quality import TierPreset
from diffserve.configs.step_cache_policy import StepCachePolicy

#: The original step cache's grid (what `calibrate-cache` searched before presets).
STEP_CACHE_THRESHOLDS = (0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 0.8, 1.2, 1.6)
STEP_CACHE_MAX_REUSE = (2, 3, 5)
DBCACHE_THRESHOLDS = (0.05, 0.1, 0.2, 0.35, 0.6, 1.0)
#: Past the top threshold (1: reuse whenever allowed), longer runs of reused steps.
DBCACHE_MAX_CONTINUOUS = (3, 5)
TEACACHE_THRESHOLDS = (0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.2, 1.6, 2.4, 3.2, 4.8, 6.4)
TAYLORSEER_INTERVALS = (2, 3, 4, 5, 6)
SCM_SCHEDULES = ("slow", "medium", "fast", "ultra")
MAGCACHE_THRESHOLDS = (0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0)
#: Steps reused in a row at most: the first along the thresholds, the others past the top one.
MAGCACHE_K = (4, 6, 10)
#: What `--methods` accepts: the original step cache and every cache method that reuses work.
CANDIDATE_METHODS = (
    "stepcache", "dbcache", "teacache", "taylorseer", "scm", "magcache", "easycache", "seacache",
)  # fmt: skip
EASYCACHE_THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2)
SEACACHE_THRESHOLDS = (0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.6)
#: Steps reused in a row at most: the first along the thresholds, the others past the top one.
SEACACHE_MAX_CONSECUTIVE = (2, 3, 5)


@dataclass(frozen=True)
class Ladder:
    """Candidate presets of one kind, from the most cautious to the most aggressive."""

    name: str
    presets: tuple[TierPreset, ...]


def step_cache_ladders(template: StepCachePolicy) -> list[Ladder]:
    """The original step cache's ladders from a tier's `template` (its first and last full steps kept)."""
    return [
        Ladder(
            f"stepcache, at most {m} reused in a row",
            tuple(replace(template, threshold=t, max_reuse_in_a_row=m) for t in STEP_CACHE_THRESHOLDS),
        )
        for m in STEP_CACHE_MAX_REUSE
    ]


def method_ladders(methods: Collection[str]) -> list[Ladder]:
    """The ladders of the cache methods among `methods` but stepcache's (`step_cache_ladders`) and
    magcache's (`magcache_ladders`: they need the model's ratios)."""
    ladders: list[Ladder] = []
    if "dbcache" in methods:
        first, *longer = DBCACHE_MAX_CONTINUOUS
        for taylorseer in (False, True):
            base = DBCacheSettings(
                Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2, enable_taylorseer=taylorseer
            )
            rungs = [
                replace(base, residual_diff_threshold=t, max_continuous_cached_steps=first)
                for t in DBCACHE_THRESHOLDS
            ]
            rungs += [replace(rungs[-1], max_continuous_cached_steps=m) for m in longer]
            ladders.append(Ladder("dbcache F1B0" + (" + taylorseer" if taylorseer else ""), tuple(rungs)))
    if "teacache" in methods:
        ladders.append(
            Ladder("teacache", tuple(TeaCacheSettings(rel_l1_thresh=t) for t in TEACACHE_THRESHOLDS))
        )
    if "taylorseer" in methods:
        for order in (1, 2):
            ladders.append(
                Ladder(
                    f"taylorseer order {order}",
                    tuple(
                        TaylorSeerSettings(
                            taylorseer_order=order, cache_interval=i, disable_cache_before_step=2
                        )
                        for i in TAYLORSEER_INTERVALS
                    ),
                )
            )
    if "scm" in methods:
        for taylorseer in (False, True):
            ladders.append(
                Ladder(
                    "scm" + (" + taylorseer" if taylorseer else ""),
                    tuple(
                        ScmSettings(steps_computation_mask=name, enable_taylorseer=taylorseer)
                        for name in SCM_SCHEDULES
                    ),
                )
            )
    if "easycache" in methods:
        ladders.append(
            Ladder("easycache", tuple(EasyCacheSettings(reuse_threshold=t) for t in EASYCACHE_THRESHOLDS))
        )
    if "seacache" in methods:
        first, *longer = SEACACHE_MAX_CONSECUTIVE
        rungs = [SeaCacheSettings(threshold=t, max_consecutive_cached=first) for t in SEACACHE_THRESHOLDS]
        rungs += [replace(rungs[-1], max_consecutive_cached=m) for m in longer]
        ladders.append(Ladder("seacache", tuple(rungs)))
    return ladders


def magcache_ladders(measured: Sequence[float] | None, family_ratios: bool) -> list[Ladder]:
    """MagCache's ladders: with the ratios the calibration `measured` on this model (None: not measured)
    and, where the family records ratios (`family_ratios`), with those (`mag_ratios` left unset, so the
    preset resolves to them: what a built-in default may use, not being tied to one checkpoint)."""
    sources: list[tuple[str, tuple[float, ...] | None]] = []
    if measured is not None:
        sources.append(("magcache, measured ratios", tuple(round(float(r), 5) for r in measured)))
    if family_ratios:
        sources.append(("magcache, the family's ratios", None))
    first, *longer = MAGCACHE_K
    ladders = []
    for name, ratios in sources:
        rungs = [
            MagCacheSettings(magcache_thresh=t, magcache_K=first, mag_ratios=ratios)
            for t in MAGCACHE_THRESHOLDS
        ]
        rungs += [replace(rungs[-1], magcache_K=k) for k in longer]
        ladders.append(Ladder(name, tuple(rungs)))
    return ladders
