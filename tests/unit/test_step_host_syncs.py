"""No host<->device traffic and no host syncs inside denoising steps (exact-tier requests, every family).

On an accelerator, a CPU tensor moved to the device (`.to(device)` of a schedule entry) is a copy from
pageable memory, which PyTorch makes synchronous, and a scalar read from the device (`.item()`,
`float(t)`, `bool(t)`) waits for all queued work: either stalls the host once per step, so the GPU idles
while the host prepares the next step. This CPU-only suite cannot see copies between devices (there is
one device), so it checks what the code *asks for* instead: while the denoising steps run (after the
request's preparation), nothing may

- move a tensor between devices or name a device for a tensor it already has (`Tensor.to(device)`,
  `.cpu()`, `.cuda()`, `copy_` across devices), which on an accelerator is a transfer or a no-op;
- read a tensor's value on the host (`.item()`, `float()`, `int()`, `bool()`, `.tolist()`, `.numpy()`,
  the ops those dispatch to, and ops that sync by design such as `torch.linalg.solve`'s error check);
- build a tensor from host data (`torch.tensor`, `torch.as_tensor`, `torch.from_numpy`);
- call the platform's `synchronize()` (step timing reads device events lazily instead).

The single-request path (`DiffGenerator` with its progress bar) and the engine's batched path
(`Engine._denoise` over several requests) are both checked, each on its second run: the first step of a new shape
builds per-shape caches (RoPE tables, Z-Image's batch layouts) once, which may move host-built
tables to the device; that is per shape, not per step. Approximate quality tiers are not checked:
their step cache reads one value per step on the host by design (`models/step_cache.py`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from diffserve import DiffGenerator, SamplingParams
from diffserve.layers.attention import AttentionBackend
from diffserve.platforms import CpuPlatform
from diffserve.request import LatentSize, Req
from diffserve.runtime import Engine, ModelRunner, SchedulerConfig

# -- the recorder -----------------------------------------------------------------------------------

#: Tensor methods that read values back to the host (a device sync on an accelerator).
HOST_READS = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "cpu", "cuda"}
#: Functions that build a tensor from host (Python / numpy) data.
HOST_DATA = {"tensor", "as_tensor", "asarray", "from_numpy"}
#: Aten ops that read a value on the host or sync by design (`linalg_solve` checks its `info` result
#: on the host; `linalg_solve_ex(check_errors=False)` does not).
SYNCING_OPS = {
    "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "masked_select",
    "_linalg_check_errors", "linalg_solve", "unique", "_unique2", "unique_consecutive", "lift_fresh",
    "lift_fresh_copy",
}  # fmt: skip


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    """`Tensor.to(...)` arguments that name a device (or a tensor whose device it takes)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _where() -> str:
    """The innermost diffserve frame that made the call, for the failure message."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/diffserve/" in frame.filename and "/tests/" not in frame.filename:
            return f"{frame.filename.split('/src/')[-1]}:{frame.lineno} ({frame.line})"
    return "?"


@dataclass
class HostTraffic:
    events: list[str] = field(default_factory=list)
    synchronize_calls: int = 0
    #: Above 0 while a part that is not a step runs (the engine decoding a finished request).
    paused: int = 0

    def add(self, what: str) -> None:
        if not self.paused:
            self.events.append(f"{what} at {_where()}")

    @contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, log: HostTraffic) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS or name in HOST_DATA:
            self.log.add(name)
        elif name == "to" and _names_a_device(args, kwargs):
            self.log.add("to naming a device")
        return func(*args, **kwargs)


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, log: HostTraffic) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.log.add(f"aten.{name}")
        elif name in ("index", "index_put", "index_put_") and _has_bool_index(args):
            self.log.add(f"aten.{name} with a boolean mask (its size is read on the host)")
        elif (
            name == "repeat_interleave"
            and func._overloadname != "self_int"
            and kwargs.get("output_size") is None
        ):
            self.log.add("aten.repeat_interleave by a tensor without output_size")
        elif name in ("_to_copy", "copy_"):
            devices = {t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
            if len(devices) > 1 or (kwargs.get("device") is not None and {kwargs["device"]} != devices):
                self.log.add(f"aten.{name} across devices")
        return func(*args, **kwargs)


class SpyCpuPlatform(CpuPlatform):
    """The CPU platform, counting `synchronize()` calls into the active recorder."""

    log: HostTraffic | None = None

    def synchronize(self, index: int = 0) -> None:
        if self.log is not None and not self.log.paused:
            self.log.synchronize_calls += 1
        super().synchronize(index)


@contextmanager
def recording(platform: SpyCpuPlatform) -> Iterator[HostTraffic]:
    log = HostTraffic()
    platform.log = log
    try:
        with _FunctionLevel(log), _DispatchLevel(log):
            yield log
    finally:
        platform.log = None


def recorded(fn: Callable, platform: SpyCpuPlatform, logs: list[HostTraffic]) -> Callable:
    """`fn`, recording its host traffic into a new entry of `logs` on every call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with recording(platform) as log:
            logs.append(log)
            return fn(*args, **kwargs)

    return wrapper


def test_the_recorder_sees_what_it_must() -> None:
    """The recorder itself catches each kind of host traffic the step code used to do, and nothing
    in plain device-side maths."""
    platform = SpyCpuPlatform()
    schedule = torch.linspace(1, 0, 5)
    repeats = torch.tensor([1, 2, 3])
    with recording(platform) as log:
        x = torch.ones(3)
        _ = x * schedule[1] + torch.arange(3, device=x.device)  # device maths, a device factory: fine
        _ = x.to(torch.float64)  # a dtype cast on the same device: fine
    assert log.events == []
    caught = [
        lambda: schedule[1].to(x.device),
        lambda: schedule.to(device=x.device, dtype=torch.bfloat16),
        lambda: float(schedule[1]),
        lambda: schedule[1].item(),
        lambda: bool(schedule[1] > 0),
        lambda: schedule.tolist(),
        lambda: torch.tensor([1.0, 2.0]),
        lambda: torch.linalg.solve(torch.eye(2), torch.ones(2)),
        lambda: x[x > 0],
        lambda: x.repeat_interleave(repeats),
        lambda: platform.synchronize(),
    ]
    for i, action in enumerate(caught):
        with recording(platform) as log:
            action()
        assert log.events or log.synchronize_calls, f"action {i} went unseen"


# -- the families -----------------------------------------------------------------------------------


def _build(name: str, root: Path) -> Path:
    """The family's tiny checkpoint (`diffserve make-tiny`'s); "wan-t2v-unipc" is wan-t2v with UniPC."""
    from diffserve.registry import TinyCheckpointOptions, family_by_name

    if name == "wan-t2v-unipc":
        return family_by_name("wan-t2v").tiny_builder(root, TinyCheckpointOptions(scheduler="unipc"))
    return family_by_name(name).tiny_builder(root, TinyCheckpointOptions())


#: Per family: params with CFG on (and embedded guidance where the DiT takes it), and params with it
#: off. Three steps, so that UniPC reaches its second-order corrector, which solves a linear system.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "flux": (
        {"guidance_scale": 3.5, "true_cfg_scale": 2.0, "negative_prompt": "ugly"},
        {"true_cfg_scale": 1.0},
    ),
    "sd3": ({"guidance_scale": 5.0}, {"guidance_scale": 1.0}),
    "qwen-image": ({"true_cfg_scale": 4.0, "negative_prompt": "blurry"}, {"true_cfg_scale": 1.0}),
    "z-image": ({"guidance_scale": 4.0}, {"guidance_scale": 0.0}),
    "longcat-image": ({"guidance_scale": 4.5}, {"guidance_scale": 1.0}),
    "wan-t2v": ({"guidance_scale": 5.0, "num_frames": 5}, {"guidance_scale": 1.0, "num_frames": 5}),
    "wan-t2v-unipc": ({"guidance_scale": 5.0, "num_frames": 5}, {"guidance_scale": 1.0, "num_frames": 5}),
    "sana-video": (
        {"guidance_scale": 5.0, "num_frames": 5, "extra": {"use_resolution_binning": False}},
        {"guidance_scale": 1.0, "num_frames": 5, "extra": {"use_resolution_binning": False}},
    ),
    # CogVideoX-2B's kind (DDIM). Its DPM folders draw each step's noise on the request's CPU generator, as
    # Diffusers does, and copy it to the device: one host-to-device copy per step by design.
    "cogvideox-t2v": (
        {"guidance_scale": 6.0, "num_frames": 5, "extra": {"use_dynamic_cfg": True}},
        {"guidance_scale": 1.0, "num_frames": 5},
    ),
}
STEPS = 3


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory) -> Iterator[tuple[str, DiffGenerator, SpyCpuPlatform]]:
    root = _build(request.param, tmp_path_factory.mktemp(request.param))
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    platform = SpyCpuPlatform()
    gen.platform = platform
    gen.engine = Engine(
        gen.pipeline, platform, gen.engine.config, attention_backend=gen.engine.attention_backend
    )
    yield request.param, gen, platform


def _params(name: str, cfg: bool = True, seed: int = 0, **extra: Any) -> SamplingParams:
    fields = {"num_inference_steps": STEPS, **CASES[name][0 if cfg else 1], **extra}
    return SamplingParams(prompt="a red fox", height=32, width=32, seed=seed, **fields)


def _report(logs: list[HostTraffic]) -> str:
    lines = sorted({event for log in logs for event in log.events})
    syncs = sum(log.synchronize_calls for log in logs)
    return "\n".join([*lines, f"platform.synchronize() calls: {syncs}"])


def test_single_request_steps_make_no_host_traffic(family) -> None:
    """`DiffGenerator` runs one request's steps (progress bar, step timing) without host traffic.

    The request runs twice and only the second is recorded: the first fills the per-shape caches (RoPE
    tables, Z-Image's batch layouts), which are built once per shape, not per step."""
    name, gen, platform = family
    engine = gen.engine
    gen.generate_from_params(_params(name))
    logs: list[HostTraffic] = []
    engine._denoise = recorded(engine._denoise, platform, logs)  # each step, after every preparation stage
    complete = engine._complete

    def complete_unrecorded(sr) -> None:
        with logs[-1].pause():
            complete(sr)

    engine._complete = complete_unrecorded
    try:
        out = gen.generate_from_params(_params(name, seed=1))
    finally:
        del engine._denoise, engine._complete
    assert len(logs) == STEPS
    assert not any(log.events or log.synchronize_calls for log in logs), f"{name}:\n{_report(logs)}"
    assert len(out.step_times) == STEPS and all(t > 0 for t in out.step_times)


def _run_engine(
    gen: DiffGenerator, platform: SpyCpuPlatform, name: str, logs: list[HostTraffic] | None
) -> list:
    """Two requests (CFG on and off, different seeds and step counts) sharing the engine's DiT batches;
    with `logs`, each batched step (and its timing) is recorded, a finished request's decoding is not."""
    scheduler = Engine(
        gen.pipeline,
        platform,
        SchedulerConfig(max_running_requests=2, batch_policy="throughput"),
        attention_backend=gen.engine.attention_backend,
    )
    if logs is not None:
        scheduler._denoise = recorded(scheduler._denoise, platform, logs)
        complete = scheduler._complete

        def complete_unrecorded(sr) -> None:
            with logs[-1].pause():
                complete(sr)

        scheduler._complete = complete_unrecorded
    srs = [
        scheduler.submit(Req(params=_params(name, seed=1))),
        scheduler.submit(Req(params=_params(name, cfg=False, seed=2, num_inference_steps=STEPS + 1))),
    ]
    scheduler.run_until_idle()
    assert [sr.state for sr in srs] == ["finished", "finished"]
    assert max(scheduler.scheduler.batch_size_counts) == 2
    return srs


def test_batched_engine_steps_make_no_host_traffic(family) -> None:
    """The engine's step loop (`Engine._denoise`: one DiT batch over requests at different steps,
    with and without CFG, and its step timing) makes no host traffic. Run twice, the first run warming
    the per-shape caches, as above."""
    name, gen, platform = family
    _run_engine(gen, platform, name, logs=None)
    logs: list[HostTraffic] = []
    srs = _run_engine(gen, platform, name, logs)
    assert len(logs) == STEPS + 1
    events = [e for log in logs for e in log.events]
    assert not events and sum(log.synchronize_calls for log in logs) == 0, f"{name}:\n{_report(logs)}"
    for sr in srs:
        assert len(sr.req.timings.steps) == sr.req.num_steps and all(t > 0 for t in sr.req.timings.steps)


# -- step timing without a sync -------------------------------------------------------------------


class FakeDevice:
    """An asynchronous device: work queued at host time t is done once `run_until(t)` is called."""

    def __init__(self) -> None:
        self.clock = 0.0  # seconds of queued work so far
        self.done_until = 0.0
        self.synchronize_calls = 0

    def queue(self, seconds: float) -> None:
        self.clock += seconds

    def run_until_end(self) -> None:
        self.done_until = self.clock


class FakeEvent:
    device: FakeDevice

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.device.clock

    def query(self) -> bool:
        return self.device.done_until >= self.at

    def synchronize(self) -> None:
        self.device.done_until = max(self.device.done_until, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event the device has not reached"
        return (end.at - self.at) * 1000.0


def _fake_accelerator() -> tuple[Any, FakeDevice]:
    from types import SimpleNamespace

    from diffserve.platforms.base import TorchAcceleratorPlatform

    device = FakeDevice()
    event = type("BoundFakeEvent", (FakeEvent,), {"device": device})

    def synchronize(index: int = 0) -> None:
        device.synchronize_calls += 1
        device.run_until_end()

    runtime = SimpleNamespace(Event=event, synchronize=synchronize)

    class FakeAcceleratorPlatform(TorchAcceleratorPlatform):
        name = "fake"
        device_type = "fake"

        @classmethod
        def is_available(cls) -> bool:
            return True

        def _runtime(self):
            return runtime

    return FakeAcceleratorPlatform(), device


def test_step_timer_reads_device_events_lazily_and_never_synchronizes() -> None:
    from diffserve.platforms.step_timer import StepTimer

    platform, device = _fake_accelerator()
    timer = StepTimer(platform)
    times: list[float] = []
    other: list[float] = []
    for seconds in (0.5, 0.25):
        start = timer.start()
        device.queue(seconds)  # the step's kernels, still running when the host moves on
        timer.stop(start, times, other)
    assert times == [] and timer.pending == 2  # nothing waited for
    device.done_until = 0.5  # the device finished the first step only
    start = timer.start()
    device.queue(0.125)
    timer.stop(start, times)
    assert times == [0.5] and other == [0.5] and timer.pending == 2
    timer.flush()
    assert times == [0.5, 0.25, 0.125] and other == [0.5, 0.25] and timer.pending == 0
    assert device.synchronize_calls == 0


def test_runner_fills_step_times_without_synchronizing() -> None:
    """The runner's steps on an asynchronous platform: every step's time, from the device's marks, and
    no `synchronize()`."""
    platform, device = _fake_accelerator()
    req = Req(params=SamplingParams(prompt="x"))

    class CountingPipeline:
        def denoise_step(self, reqs: list[Req]) -> None:
            device.queue(0.25 * (1 + reqs[0].step_index))
            reqs[0].step_index += 1

    runner = ModelRunner(CountingPipeline(), platform, AttentionBackend.SDPA)
    for _ in range(4):
        runner.denoise_step([req])
    runner.flush_step_times()
    assert req.timings.steps == [0.25, 0.5, 0.75, 1.0]
    assert device.synchronize_calls == 0


def test_cpu_step_times_are_filled_at_once() -> None:
    from diffserve.platforms.step_timer import StepTimer

    timer = StepTimer(CpuPlatform())
    times: list[float] = []
    start = timer.start()
    _ = torch.ones(64, 64) @ torch.ones(64, 64)
    timer.stop(start, times)
    assert len(times) == 1 and times[0] > 0 and timer.pending == 0


# -- what moved off the step keeps its numerics -----------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 9, 28, 50])
@pytest.mark.parametrize("dynamic", [False, True])
def test_zimage_dit_time_is_what_each_step_computed(steps: int, dynamic: bool) -> None:
    """Z-Image's DiT time, now computed for the whole schedule at preparation, equals bit for bit the
    per-step 0-d computation the denoiser did before."""
    from diffserve.families.z_image.conditioning import ZImageConditioning
    from diffserve.families.z_image.stages import ZImageTimestepPreparationStage
    from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler

    scheduler = FlowMatchEulerScheduler(shift=3.0, use_dynamic_shifting=dynamic)
    req = Req(params=SamplingParams(prompt="x", num_inference_steps=steps))
    req.latents, req.latent_size = torch.zeros(1, 4, 64, 48), LatentSize(64, 48)
    ZImageTimestepPreparationStage(scheduler).forward(req)
    per_step = torch.stack([(1000 - req.schedule.timesteps[i]) / 1000 for i in range(steps)])
    dit_timesteps = ZImageConditioning.of(req).dit_timesteps
    assert dit_timesteps.dtype == torch.float32
    assert torch.equal(dit_timesteps, per_step)


def test_unchecked_solve_equals_linalg_solve() -> None:
    from diffserve.models.schedulers.unipc_flow import solve_without_host_check

    gen = torch.Generator().manual_seed(0)
    for order in (2, 3, 4):
        ratios = torch.cat([torch.rand(order - 1, generator=gen) * 3 - 1.5, torch.ones(1)])
        rows = torch.stack([ratios**i for i in range(order)])
        rhs = torch.randn(order, generator=gen)
        assert torch.equal(solve_without_host_check(rows, rhs), torch.linalg.solve(rows, rhs))


def test_unipc_refuses_a_schedule_its_unchecked_solves_cannot_take() -> None:
    from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler

    with pytest.raises(ValueError, match="strictly decreasing"):
        UniPCFlowScheduler().schedule(3, sigmas=[0.9, 0.5, 0.5])
    UniPCFlowScheduler(solver_order=1).schedule(3, sigmas=[0.9, 0.5, 0.5])  # order 1 solves nothing


def test_unipc_step_wants_its_sigmas_on_the_sample_device() -> None:
    """A step never moves sigmas itself (that was a host-to-device copy per sigma per step)."""
    from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler

    scheduler = UniPCFlowScheduler()
    schedule = scheduler.schedule(3)
    sample = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="sample's device"):
        scheduler.step(sample, sample, schedule.sigmas.to("meta"), 0, scheduler.new_state(), schedule.sigmas)
    with pytest.raises(ValueError, match="CPU copy"):
        scheduler.step(sample, sample, schedule.sigmas, 0, scheduler.new_state(), schedule.sigmas.to("meta"))
