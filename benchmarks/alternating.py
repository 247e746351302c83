"""In-process alternating A/B: several engines loaded in one process, timed in rotating rounds.

The per-process scripts (`bench_speed.py`, `bench_families.py`) isolate engines in fresh processes,
which memory and time-to-first-image need. But on the shared 2-core VM the speed of a whole process
drifts: one process of an engine can run 15-50% slower than its others for minutes, so per-process
medians carry that drift into every ratio. Here every engine is loaded once, warmed up once (untimed:
diffusers' torch.compile compiles there), inductor's compile workers are shut down, and then each
round runs every engine once in a rotating order. A ratio is computed per round from two engines timed
seconds apart, and summarized as the median over rounds with its range.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import harness

#: Loads one engine and returns its `generate()`: one whole generation -> (image, s of each step).
Loader = Callable[[], harness.Generate]


@dataclass
class RoundTimes:
    """One engine's timings, one entry per round."""

    s_per_step: list[float] = field(default_factory=list)  # median over the generation's steps
    end_to_end_s: list[float] = field(default_factory=list)
    image: Any = None  # the last generation's image


def rotated(engines: Sequence[str], round_: int) -> list[str]:
    shift = round_ % len(engines)
    return [*engines[shift:], *engines[:shift]]


def time_alternating(loaders: dict[str, Loader], rounds: int, label: str) -> dict[str, RoundTimes]:
    """Load every engine, warm each up once, then `rounds` rounds of one generation per engine."""
    generators = {}
    for engine, load in loaders.items():
        print(f"  {label}: loading and warming up {engine} ...", file=sys.stderr, flush=True)
        generate = load()
        generate()  # untimed: diffusers' torch.compile compiles here
        generators[engine] = generate
    harness.stop_compile_workers()
    times = {engine: RoundTimes() for engine in loaders}
    for round_ in range(rounds):
        for engine in rotated(list(loaders), round_):
            start = time.perf_counter()
            image, step_times = generators[engine]()
            times[engine].end_to_end_s.append(time.perf_counter() - start)
            times[engine].s_per_step.append(statistics.median(step_times))
            times[engine].image = image
        print(f"  {label}: round {round_ + 1}/{rounds} done", file=sys.stderr, flush=True)
    del generators
    gc.collect()
    return times


@dataclass(frozen=True)
class PairedRatio:
    """numerator time / denominator time, per round (> 1: the denominator engine is faster)."""

    numerator: str
    denominator: str
    per_round: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.per_round)

    def cell(self, bar: float | None = None) -> str:
        """'1.23x (1.10-1.40)', with ' PASS'/' MISS' and the rounds at the bar when `bar` is given."""
        text = f"**{self.median:.2f}x** ({min(self.per_round):.2f}-{max(self.per_round):.2f})"
        if bar is None:
            return text
        above = sum(r >= bar for r in self.per_round)
        return f"{text} {'PASS' if self.median >= bar else 'MISS'}, {above}/{len(self.per_round)} rounds"


def paired(
    times: dict[str, RoundTimes], numerator: str, denominator: str, metric: str = "s_per_step"
) -> PairedRatio:
    pairs = zip(getattr(times[numerator], metric), getattr(times[denominator], metric), strict=True)
    return PairedRatio(numerator, denominator, tuple(n / d for n, d in pairs))


def median_cell(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
