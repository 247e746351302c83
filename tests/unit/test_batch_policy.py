"""The batch policy (`--batch-policy`, runtime/batch_policy.py): its choices on measured curves, and the
engine under each policy on a virtual clock, where a DiT step of `rows` rows costs what a cost model says.
The clock makes throughput and latency exact and independent of the machine's load: the issue's two
regimes are an overhead-bound step (the tiny FLUX: 8 rows cost 5.3x one row) and a compute-bound one (the
36.6M FLUX at 256x256: 8 rows cost 8.35x one row). `benchmarks/bench_batch_policy.py` measures the same on
real models."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from diffserve.configs.sampling_params import SamplingParams
from diffserve.layers.attention import AttentionBackend
from diffserve.platforms.cpu import CpuPlatform
from diffserve.platforms.step_timer import HostMark, StepMark
from diffserve.request import Req
from diffserve.runtime import Engine, EngineEvents, SchedulerConfig
from diffserve.runtime.batch_policy import (
    AGEING_PER_SKIP,
    BatchPolicy,
    Candidate,
    StepCostCurve,
    step_order,
    token_bucket,
)
from diffserve.testing.fake_pipeline import FakePipeline


def overhead_bound(rows: int) -> float:
    return 0.386 + 0.614 * rows


def compute_bound(rows: int) -> float:
    return 1.05 * rows - 0.05


def curve_of(cost: Callable[[int], float], rows: list[int], bucket: int = 256) -> StepCostCurve:
    curve = StepCostCurve()
    for r in rows:
        curve.samples(bucket, r).extend([cost(r)] * 3)
    return curve


# -- the policy's choices ----------------------------------------------------------------------------
def test_token_bucket_rounds_up_to_a_power_of_two() -> None:
    assert [token_bucket(t) for t in (1, 2, 3, 256, 257, 4096)] == [1, 2, 4, 256, 512, 4096]


def test_throughput_takes_all_and_latency_takes_one() -> None:
    assert BatchPolicy("throughput").choose(256, [1] * 8) == 8
    assert BatchPolicy("latency").choose(256, [2] * 8) == 1
    with pytest.raises(ValueError, match="batch policy must be one of auto, throughput, latency"):
        BatchPolicy("fastest")


def test_auto_measures_one_then_doubles_while_batching_pays() -> None:
    policy = BatchPolicy("auto")
    assert policy.choose(256, [1] * 8) == 1 and policy.last_reason[256] == "measuring"
    policy.curve.samples(256, 1).extend([overhead_bound(1)] * 2)
    seen = []
    for _ in range(4):
        k = policy.choose(256, [1] * 8)
        seen.append((k, policy.last_reason[256]))
        policy.curve.samples(256, k).extend([overhead_bound(k)] * 2)
    assert seen == [(2, "exploring"), (4, "exploring"), (8, "exploring"), (8, "measured")]


def test_auto_stops_growing_where_rows_cost_as_much_each() -> None:
    policy = BatchPolicy("auto", curve_of(compute_bound, [1]))
    assert policy.choose(256, [1] * 8) == 2 and policy.last_reason[256] == "exploring"
    policy.curve.samples(256, 2).extend([compute_bound(2)] * 2)
    assert policy.choose(256, [1] * 8) == 1 and policy.last_reason[256] == "measured"
    assert policy.running_room(256) == 2  # the next request is admitted (encoded) while one steps
    assert BatchPolicy("auto").running_room(512) == 2 and BatchPolicy("throughput").running_room(512) is None


def test_auto_counts_rows_not_requests() -> None:
    """CFG requests bring two rows each: the curve is read at the batch's rows."""
    policy = BatchPolicy("auto", curve_of(overhead_bound, [2, 4, 8]))
    assert policy.choose(256, [2, 2, 2, 2]) == 4  # 8 rows, measured and cheapest per row
    policy = BatchPolicy("auto", curve_of(compute_bound, [2, 4, 8]))
    assert policy.choose(256, [2, 2, 2, 2]) == 1


def test_auto_interpolates_between_measured_batches() -> None:
    curve = curve_of(overhead_bound, [1, 2, 8])
    assert curve.per_row(256, 5) == pytest.approx(overhead_bound(5) / 5)
    assert curve.per_row(256, 9) is None  # above the largest measured batch: unknown


def test_auto_re_measures_around_its_choice_now_and_then() -> None:
    policy = BatchPolicy("auto", curve_of(compute_bound, [1, 2]))
    choices = [policy.choose(256, [1] * 4) for _ in range(128)]
    assert choices.count(1) == 126 and choices[63] == 2  # one step above its choice every 64


def test_the_first_time_of_a_shape_is_dropped_once_there_is_another() -> None:
    curve = StepCostCurve()
    curve.samples(256, 1).extend([9.0])
    assert curve.seconds(256, 1) == 9.0
    curve.samples(256, 1).extend([1.0, 1.2])
    assert curve.seconds(256, 1) == pytest.approx(1.1)
    curve.samples(256, 1)  # the engine's next hand-out drops it for good
    assert curve.snapshot() == {"256": {"1": {"seconds": 1.1, "seconds_per_row": 1.1, "samples": 2}}}


def test_step_order_is_shortest_remaining_first_with_ageing() -> None:
    long_waiting = Candidate(rows=1, remaining_steps=20, priority=0, seq=0)
    short = Candidate(rows=1, remaining_steps=5, priority=0, seq=1)
    urgent = Candidate(rows=1, remaining_steps=30, priority=1, seq=2)
    assert step_order([long_waiting, short, urgent]) == [2, 1, 0]
    skips = int((20 - 5) / AGEING_PER_SKIP) + 1  # passed over this often, it goes before the short one
    aged = Candidate(rows=1, remaining_steps=20, priority=0, seq=0, skipped_steps=skips)
    assert step_order([aged, short]) == [0, 1]


# -- the engine on a virtual clock -------------------------------------------------------------------
@dataclass
class VirtualClock:
    now: float = 0.0


class VirtualClockPlatform(CpuPlatform):
    """The CPU platform whose step marks read a virtual clock that only the fake DiT advances."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def step_mark(self) -> StepMark:
        mark = HostMark()
        mark.time = self.clock.now
        return mark


class CostedPipeline(FakePipeline):
    """A fake pipeline whose DiT step advances the clock by `cost(rows)`."""

    def __init__(self, clock: VirtualClock, cost: Callable[[int], float]) -> None:
        super().__init__()
        self.clock, self.cost = clock, cost

    def denoise_step(self, reqs: list[Req]) -> None:
        self.clock.now += self.cost(len(reqs))
        super().denoise_step(reqs)


@dataclass
class Served:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies)


def serve_closed_loop(
    cost: Callable[[int], float], policy: str, max_running: int, requests: int = 16, concurrency: int = 8
) -> Served:
    """`requests` six-step requests, `concurrency` outstanding at a time (a new one as one finishes)."""
    clock = VirtualClock()
    finished: list = []

    class Events(EngineEvents):
        def on_finished(self, sr) -> None:
            finished.append(sr)

    engine = Engine(
        CostedPipeline(clock, cost), VirtualClockPlatform(clock),
        SchedulerConfig(max_running_requests=max_running, batch_policy=policy), Events(),
        attention_backend=AttentionBackend.SDPA,
    )  # fmt: skip
    submitted_at: dict[str, float] = {}
    served = Served()

    def submit(i: int) -> None:
        req = Req(params=SamplingParams(prompt=f"request {i}", seed=i, num_inference_steps=6))
        sr = engine.submit(req)
        submitted_at[sr.request_id] = clock.now

    for i in range(concurrency):
        submit(i)
    sent = concurrency
    while engine.has_work:
        engine.step()
        while len(served.latencies) < len(finished):
            sr = finished[len(served.latencies)]
            served.latencies.append(clock.now - submitted_at[sr.request_id])
            served.batch_sizes += sr.batch_sizes
            if sent < requests:
                submit(sent)
                sent += 1
    served.seconds = clock.now
    assert len(served.latencies) == requests
    return served


@pytest.mark.parametrize("cost", [overhead_bound, compute_bound], ids=["overhead-bound", "compute-bound"])
def test_auto_serves_as_fast_as_the_better_of_one_at_a_time_and_full_batches(cost) -> None:
    one = serve_closed_loop(cost, "throughput", max_running=1)
    full = serve_closed_loop(cost, "throughput", max_running=8)
    auto = serve_closed_loop(cost, "auto", max_running=8)
    for name, s in (("one at a time", one), ("full batches", full), ("auto", auto)):
        mean_batch = sum(s.batch_sizes) / len(s.batch_sizes)
        print(
            f"{cost.__name__} {name}: {s.throughput:.4f} req/s, p50 {s.p50:.2f} s, mean batch {mean_batch:.2f}"
        )
    assert auto.throughput >= 0.97 * max(one.throughput, full.throughput)
    assert auto.p50 <= 1.01 * one.p50


def test_latency_policy_serves_like_one_at_a_time() -> None:
    one = serve_closed_loop(overhead_bound, "throughput", max_running=1)
    latency = serve_closed_loop(overhead_bound, "latency", max_running=8)
    assert set(latency.batch_sizes) == {1}
    assert latency.p50 == pytest.approx(one.p50) and latency.seconds == pytest.approx(one.seconds)
