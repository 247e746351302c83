"""How many of the running requests share the next DiT step (`--batch-policy`), from measured step times.

Step batching pays where a step is bound by overhead (kernel launches, small matrices): eight rows cost
little more than one. Where a step is bound by compute, eight rows cost eight times one, so batching them
gains no throughput and multiplies every request's latency by the batch. `StepCostCurve` keeps the measured
step seconds per token bucket (a request's latent tokens per row, rounded up to a power of two) and DiT
rows (requests x CFG branches x outputs); `BatchPolicy` reads it at every step boundary:

- `throughput`: every running request of the group whose turn it is (round-robin over shapes).
- `latency`: one request at a time, shortest remaining first (`step_order`).
- `auto` (default): the group of the first request in `step_order`, cut to the number of requests whose
  rows cost least per row, as measured: one request alone unless a batch costs at least `MIN_GAIN` less
  per row, else the smallest batch within `TOLERANCE` of the cheapest (its throughput, less latency). Rows beyond the largest measured batch are unknown: while the largest measured batch is also
  the best, the policy tries about twice its rows once (an exploration step that does useful work), and
  every `REPROBE_EVERY` decisions of a bucket it re-measures one batch above and one below its choice, so a
  curve measured under a passing load is corrected while serving.

`step_order` is shortest remaining steps first among equal priorities, ageing a request that is passed
over (`AGEING_PER_SKIP` of a step per step it waits), so a long request is delayed by shorter ones but
never starved; arrival order breaks ties."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from diffserve.configs.batching import BATCH_POLICIES, BatchPolicyName

#: Batching must cost at least this much less per row than one request alone (measurement noise aside) ...
MIN_GAIN = 0.05
#: ... and then the smallest batch within this of the cheapest per row is taken.
TOLERANCE = 0.01
#: Step times kept per (bucket, rows); the median of these is the curve's value.
WINDOW = 8
#: Decisions of a bucket between two re-measurements around its choice.
REPROBE_EVERY = 64
#: A request passed over for a step moves this many steps closer to the front of `step_order`.
AGEING_PER_SKIP = 0.25


def token_bucket(tokens: int) -> int:
    """The size bucket of a request with `tokens` latent tokens per row: the next power of two."""
    return 1 << max(int(tokens) - 1, 0).bit_length()


@dataclass(frozen=True)
class Candidate:
    """A running request as the policy sees it: its DiT rows, remaining steps, priority and arrival."""

    rows: int
    remaining_steps: int
    priority: int
    seq: int
    skipped_steps: int = 0

    @property
    def order(self) -> tuple[int, float, int]:
        return (-self.priority, self.remaining_steps - AGEING_PER_SKIP * self.skipped_steps, self.seq)


def step_order(candidates: Sequence[Candidate]) -> list[int]:
    """Indices of `candidates` in the order they get a DiT step (see the module docstring)."""
    return sorted(range(len(candidates)), key=lambda i: candidates[i].order)


@dataclass
class StepCostCurve:
    """Measured seconds of one DiT step per (token bucket, rows). `samples` hands out the list a step's time
    is appended to (the step timer resolves it once the device has passed the step)."""

    window: int = WINDOW
    _samples: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    #: Keys whose first time was dropped: a shape's first step pays one-off costs (allocation, kernel
    #: selection) that later steps do not.
    _warm: set[tuple[int, int]] = field(default_factory=set)

    def samples(self, bucket: int, rows: int) -> list[float]:
        """The list the next step's time goes to (on the engine's thread, which alone changes the lists):
        trimmed to the last `window` times, and without a shape's first time once it has a second."""
        key = (bucket, rows)
        times = self._samples.setdefault(key, [])
        if key not in self._warm and len(times) > 1:
            del times[0]
            self._warm.add(key)
        del times[: -self.window]
        return times

    def seconds(self, bucket: int, rows: int) -> float | None:
        """The median of the last `window` times of a step of `rows` rows in `bucket` (the first time
        left out once there is another); None: not measured. Reads copies: any thread may call it."""
        key = (bucket, rows)
        times = list(self._samples.get(key, ()))
        if key not in self._warm and len(times) > 1:
            times = times[1:]
        if not times:
            return None
        return statistics.median(times[-self.window :])

    def measured_rows(self, bucket: int) -> list[int]:
        return sorted(r for (b, r), times in list(self._samples.items()) if b == bucket and times)

    def per_row(self, bucket: int, rows: int) -> float | None:
        """Seconds per row of a `rows`-row step: measured, or interpolated between the two measured batches
        around it (step time is close to affine in rows); None above the largest measured batch."""
        measured = self.measured_rows(bucket)
        if not measured or rows > measured[-1]:
            return None
        if rows < measured[0]:
            return None
        below = max(r for r in measured if r <= rows)
        above = next(r for r in measured if r >= rows)
        t_below, t_above = self.seconds(bucket, below), self.seconds(bucket, above)
        assert t_below is not None and t_above is not None
        seconds = (
            t_below if above == below else t_below + (t_above - t_below) * (rows - below) / (above - below)
        )
        return seconds / rows

    def snapshot(self) -> dict[str, dict[str, dict[str, float | int]]]:
        """For /server_info and the metrics: {bucket: {rows: {"seconds", "seconds_per_row", "samples"}}}."""
        out: dict[str, dict[str, dict[str, float | int]]] = {}
        samples = dict(self._samples)  # a copy: the engine's thread may add a shape meanwhile
        for bucket, rows in sorted(k for k, times in samples.items() if times):
            seconds = self.seconds(bucket, rows)
            assert seconds is not None
            out.setdefault(str(bucket), {})[str(rows)] = {
                "seconds": round(seconds, 6),
                "seconds_per_row": round(seconds / rows, 6),
                "samples": len(samples[(bucket, rows)]),
            }
        return out


class BatchPolicy:
    """Chooses how many requests, in `step_order`, share the next DiT step of a group (module docstring)."""

    def __init__(self, name: str = "auto", curve: StepCostCurve | None = None) -> None:
        if name not in BATCH_POLICIES:
            raise ValueError(f"batch policy must be one of {', '.join(BATCH_POLICIES)}, got {name!r}")
        self.name: BatchPolicyName = name  # type: ignore[assignment]  # checked above
        self.curve = curve or StepCostCurve()
        self._decisions: dict[int, int] = {}
        #: The last number of requests chosen per bucket (admission keeps at most twice as many running).
        self._last_choice: dict[int, int] = {}
        #: Why the last decision per bucket was made ("measured", "exploring", "re-measuring", ...).
        self.last_reason: dict[int, str] = {}

    def choose(self, bucket: int, rows: Sequence[int]) -> int:
        """How many of the candidates (their DiT rows, in `step_order`) run the next step: 1..len(rows)."""
        if not rows:
            return 0
        if self.name == "throughput":
            return len(rows)
        if self.name == "latency":
            return 1
        count = self._decisions[bucket] = self._decisions.get(bucket, 0) + 1
        chosen, reason = self._auto(bucket, rows, count)
        self.last_reason[bucket] = reason
        self._last_choice[bucket] = chosen
        return chosen

    def running_room(self, bucket: int) -> int | None:
        """How many requests of `bucket` may be denoising at once under this policy (None: no limit beyond
        the scheduler's): `latency` one; `auto` twice its last choice, two before its first (room for the
        next, larger batch it may try, and for the next request to be encoded while the chosen ones step)."""
        if self.name == "latency":
            return 1
        if self.name == "auto":
            return 2 * self._last_choice.get(bucket, 1)
        return None

    def _auto(self, bucket: int, rows: Sequence[int], count: int) -> tuple[int, str]:
        prefix = list(itertools.accumulate(rows))
        measured = self.curve.measured_rows(bucket)
        if not measured:
            return 1, "measuring"
        costs: list[float] = []
        for total in prefix:
            cost = self.curve.per_row(bucket, total)
            if cost is None:
                break
            costs.append(cost)
        best = _smallest_near_cheapest(costs)
        if best == 0:  # even one request's rows are below or above what was measured: measure them
            return 1, "measuring"
        if prefix[-1] > measured[-1] and prefix[best - 1] >= measured[-1] * 0.75:
            # The best is at the measured frontier: try about twice its rows once.
            target = 2 * measured[-1]
            return next(
                (k for k, total in enumerate(prefix, start=1) if total >= target), len(prefix)
            ), "exploring"
        if count % REPROBE_EVERY == 0 and best < len(prefix):
            return best + 1, "re-measuring"
        if count % REPROBE_EVERY == REPROBE_EVERY // 2 and best > 1:
            return best - 1, "re-measuring"
        return best, "measured"

    def describe(self) -> dict[str, object]:
        """What /server_info shows: the policy, the measured curve, and the last decision's reason per bucket."""
        return {
            "policy": self.name,
            "step_seconds": self.curve.snapshot(),
            "last_decision": {str(b): reason for b, reason in sorted(dict(self.last_reason).items())},
        }


def _smallest_near_cheapest(costs: Sequence[float]) -> int:
    """How many requests to batch given the seconds per row of batching 1, 2, ... of them (0: none known):
    one, unless some batch costs `MIN_GAIN` less per row; then the smallest within `TOLERANCE` of the
    cheapest (the throughput of the cheapest, at less latency)."""
    if not costs:
        return 0
    cheapest = min(costs)
    if cheapest > costs[0] * (1 - MIN_GAIN):
        return 1
    return next(k for k, cost in enumerate(costs, start=1) if cost <= cheapest * (1 + TOLERANCE))
