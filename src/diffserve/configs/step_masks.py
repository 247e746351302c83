"""Steps computation masks (SCM): which denoising steps run the DiT's cached blocks, per step, 1 or 0.

A mask is a list with one entry per step: 1 computes the step, 0 lets the cache method reuse its cached
residual there (with cache-dit's "dynamic" policy only when its own test also allows it, with "static"
always). Besides an explicit list, a request may name one of cache-dit's schedules ("slow", "medium",
"fast", "ultra"): alternating runs of computed and cached steps, designed for 28 steps and stretched or cut
to the request's step count the way cache-dit's `steps_mask(total_steps=..., mask_policy=...)` does, so
that a named schedule selects the same steps in diffserve as in cache-dit. The last step always computes.

Pure Python (no torch): the front ends check names here before a model is loaded.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

#: The named schedules' (compute runs, cache runs) at 28 steps: compute 8, cache 1, compute 3, ...
_AT_28_STEPS: dict[str, tuple[list[int], list[int]]] = {
    "slow": ([8, 3, 3, 2, 1, 1], [1, 2, 2, 2, 3]),  # 18 computed, 10 cached
    "medium": ([6, 2, 2, 2, 2, 1], [1, 3, 3, 3, 3]),  # 15 computed, 13 cached
    "fast": ([6, 1, 1, 1, 1, 1], [1, 3, 4, 5, 4]),  # 11 computed, 17 cached
    "ultra": ([4, 1, 1, 1, 1], [2, 5, 6, 7]),  # 8 computed, 20 cached
}
#: Few-step (distilled) schedules: 10 to 15 steps, 9 steps (Z-Image-Turbo) and 8 steps.
_UP_TO_15_STEPS: dict[str, tuple[list[int], list[int]]] = {
    "slow": ([4, 2, 2, 2, 1], [1, 1, 1, 1]),
    "medium": ([4, 2, 1, 1, 1], [1, 1, 2, 2]),
    "fast": ([3, 1, 1, 1, 1], [1, 2, 2, 3]),
    "ultra": ([2, 1, 1, 1, 1], [1, 2, 3, 3]),
}
_AT_9_STEPS: dict[str, tuple[list[int], list[int]]] = {
    "slow": ([5, 2, 1], [1]),
    "medium": ([5, 1, 1], [1, 1]),
    "fast": ([4, 1, 1], [1, 2]),
    "ultra": ([3, 1, 1], [2, 2]),
}
_AT_8_STEPS: dict[str, tuple[list[int], list[int]]] = {
    "slow": ([5, 1, 1], [1]),
    "medium": ([4, 1, 1], [1, 1]),
    "fast": ([3, 1, 1], [1, 2]),
    "ultra": ([2, 1, 1], [2, 2]),
}
_AT_4_STEPS = ([2, 1], [1])
_AT_6_STEPS = ([3, 1], [2])

#: The names a request may give as `steps_computation_mask`.
SCHEDULE_NAMES = tuple(_AT_28_STEPS)


def mask_from_runs(compute_runs: Sequence[int], cache_runs: Sequence[int], total_steps: int) -> list[int]:
    """Alternate `compute_runs[i]` ones and `cache_runs[i]` zeros, cut to `total_steps` entries.

    ValueError when the runs cover fewer than `total_steps` steps."""
    if sum(compute_runs) + sum(cache_runs) < total_steps:
        raise ValueError(
            f"compute runs {list(compute_runs)} and cache runs {list(cache_runs)} cover "
            f"{sum(compute_runs) + sum(cache_runs)} steps, fewer than {total_steps}"
        )
    mask: list[int] = []
    for i in range(max(len(compute_runs), len(cache_runs))):
        mask += [1] * (compute_runs[i] if i < len(compute_runs) else 0)
        mask += [0] * (cache_runs[i] if i < len(cache_runs) else 0)
    return mask[:total_steps]


def _length(runs: tuple[list[int], list[int]]) -> int:
    return sum(runs[0]) + sum(runs[1])


def _cut(runs: tuple[list[int], list[int]], total_steps: int) -> tuple[list[int], list[int]]:
    """Shorten the runs from the end, a cached step then a computed one, until they cover `total_steps`."""
    compute, cache = runs
    while _length(runs) > total_steps:
        if cache:
            cache[-1] -= 1
            if cache[-1] == 0:
                cache.pop()
        if _length(runs) <= total_steps:
            break
        if compute:
            compute[-1] -= 1
            if compute[-1] == 0:
                compute.pop()
    return runs


def _stretch(runs: tuple[list[int], list[int]], total_steps: int) -> tuple[list[int], list[int]]:
    """Lengthen 28-step runs to `total_steps` keeping their compute/cache ratio: each run grows by about
    half its length times total_steps / 28 per round (at least one step), computed runs first."""
    compute, cache = runs
    base_compute, base_cache = list(compute), list(cache)
    paired = min(len(compute), len(cache))
    while _length(runs) < total_steps:
        for i in range(paired):
            compute[i] += max(int(base_compute[i] * (total_steps / 28) * 0.5), 1)
            if _length(runs) >= total_steps:
                break
            cache[i] += max(int(base_cache[i] * (total_steps / 28) * 0.5), 1)
            if _length(runs) >= total_steps:
                break
        if _length(runs) >= total_steps:
            break
        compute[-1] += 1
    return runs


def named_schedule(name: str, total_steps: int) -> list[int]:
    """cache-dit's schedule `name` (`SCHEDULE_NAMES`) for `total_steps` steps; its last step computes.

    ValueError for an unknown name, or a step count below 8 other than 4 and 6 (cache-dit has no schedule
    there)."""
    if name not in _AT_28_STEPS:
        raise ValueError(
            f"unknown steps_computation_mask schedule {name!r}; one of {', '.join(SCHEDULE_NAMES)}"
        )
    if total_steps >= 16:
        runs = copy.deepcopy(_AT_28_STEPS[name])
        runs = _stretch(runs, total_steps) if total_steps > 28 else runs
    elif total_steps >= 10:
        runs = copy.deepcopy(_UP_TO_15_STEPS[name])
    elif total_steps == 9:
        runs = copy.deepcopy(_AT_9_STEPS[name])
    elif total_steps == 8:
        runs = copy.deepcopy(_AT_8_STEPS[name])
    elif total_steps in (4, 6):
        runs = copy.deepcopy(_AT_4_STEPS if total_steps == 4 else _AT_6_STEPS)
    else:
        raise ValueError(
            f"the named steps_computation_mask schedules need 4, 6 or at least 8 steps, the request has "
            f"{total_steps}; pass an explicit list of 1/0 per step instead"
        )
    mask = mask_from_runs(*_cut(runs, total_steps), total_steps)
    mask[-1] = 1
    return mask
