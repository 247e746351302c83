"""The engine (`Engine`: `StepScheduler` decides, `ModelRunner` runs) in-process on tiny checkpoints: batch invariance (8 mixed requests batched vs each
alone), joining mid-way, cancellation mid-batch, fair alternation between shape groups, the
max_running_requests / max_batch_tokens limits, priorities, memory admission and failure isolation."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffGenerator, SamplingParams
from diffserve.request import Req
from diffserve.runtime import (
    Engine,
    EngineEvents,
    MemoryModel,
    RequestCost,
    RequestTooLargeError,
    SchedulerConfig,
)
from diffserve.testing.image_metrics import psnr_uint8

H, W = 32, 48

#: Eight requests that differ in everything a request can set: steps, guidance, CFG on/off, seed, n.
MIXED = [
    {"num_inference_steps": 4, "guidance_scale": 3.5},
    {"num_inference_steps": 3, "guidance_scale": 1.0, "true_cfg_scale": 3.0, "negative_prompt": "ugly"},
    {"num_inference_steps": 5, "guidance_scale": 5.0, "num_outputs_per_prompt": 2},
    {"num_inference_steps": 2, "guidance_scale": 2.0},
    {"num_inference_steps": 6, "guidance_scale": 4.0, "true_cfg_scale": 2.0, "negative_prompt": "dark"},
    {"num_inference_steps": 4, "guidance_scale": 0.0},
    {"num_inference_steps": 3, "guidance_scale": 7.0, "num_outputs_per_prompt": 3},
    {"num_inference_steps": 5, "guidance_scale": 3.0, "true_cfg_scale": 1.5, "negative_prompt": "noisy"},
]


@pytest.fixture(scope="module")
def flux(tiny_flux_dir) -> DiffGenerator:
    return DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def zimage(tmp_path_factory) -> DiffGenerator:
    from diffserve.families.z_image.tiny import build_tiny_zimage

    root = build_tiny_zimage(tmp_path_factory.mktemp("tiny-zimage"))
    return DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)


def params(i: int, height: int = H, width: int = W, **extra) -> SamplingParams:
    return SamplingParams(
        prompt=f"prompt number {i} of a fox", height=height, width=width, seed=100 + i, **extra
    )


def pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im) for im in images]).astype(int)


def alone(gen: DiffGenerator, p: SamplingParams) -> np.ndarray:
    return pixels(gen.generate_from_params(p).images)


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    diff = int(np.abs(got - want).max())
    value = psnr_uint8(got, want)
    print(f"{what}: max abs pixel diff {diff}, PSNR {value:.1f} dB")
    assert got.shape == want.shape and diff <= 1 and value >= 45.0


class Recorder(EngineEvents):
    def __init__(self, scheduler_ref: list) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.failed: dict[str, BaseException] = {}
        self.running_at_start: list[int] = []
        self.tokens_at_start: list[int] = []
        self._scheduler = scheduler_ref

    def on_started(self, sr) -> None:
        self.started.append(sr.request_id)
        s = self._scheduler[0].scheduler
        self.running_at_start.append(s.num_running)
        self.tokens_at_start.append(s.running_tokens())

    def on_finished(self, sr) -> None:
        self.finished.append(sr.request_id)

    def on_cancelled(self, sr) -> None:
        self.cancelled.append(sr.request_id)

    def on_failed(self, sr, error) -> None:
        self.failed[sr.request_id] = error


def make(gen: DiffGenerator, pipeline=None, **config) -> tuple[Engine, Recorder]:
    """A fresh engine over the generator's pipeline (or `pipeline`, wrapping it), with recorded events; the
    `throughput` batch policy unless named (these tests check batching itself, whatever it costs)."""
    config.setdefault("batch_policy", "throughput")
    ref: list = []
    events = Recorder(ref)
    memory = config.pop("memory", None)
    engine = Engine(
        pipeline or gen.pipeline, gen.platform, SchedulerConfig(**config), events, memory=memory,
        attention_backend=gen.engine.attention_backend,
    )  # fmt: skip
    ref.append(engine)
    return engine, events


def request_cost(gen: DiffGenerator, p: SamplingParams) -> RequestCost:
    """What the engine charges for `p` (validated as at submission)."""
    return gen.engine.cost(gen.pipeline.validate(Req(params=p)))


# -- batch invariance ------------------------------------------------------------------------------
def test_eight_mixed_requests_batched_equal_each_alone(flux) -> None:
    ps = [params(i, **extra) for i, extra in enumerate(MIXED)]
    want = [alone(flux, p) for p in ps]
    scheduler, events = make(flux, max_running_requests=8)
    srs = [scheduler.submit(Req(params=p)) for p in ps]
    scheduler.run_until_idle()
    assert sorted(events.finished) == sorted(sr.request_id for sr in srs) and not events.failed
    assert scheduler.scheduler.max_running_seen == 8 and max(scheduler.scheduler.batch_size_counts) == 8
    for i, (sr, expected) in enumerate(zip(srs, want, strict=True)):
        assert_same(pixels(sr.req.outputs.images), expected, f"flux request {i} ({MIXED[i]})")


def test_zimage_mixed_requests_batched_equal_each_alone(zimage) -> None:
    extras = [
        {"num_inference_steps": 4, "guidance_scale": 4.0},
        {"num_inference_steps": 3, "guidance_scale": 0.0},
        {"num_inference_steps": 5, "guidance_scale": 2.0, "negative_prompt": "blurry and dark"},
        {"num_inference_steps": 2, "guidance_scale": 3.0, "num_outputs_per_prompt": 2},
    ]
    ps = [params(i, **extra) for i, extra in enumerate(extras)]
    want = [alone(zimage, p) for p in ps]
    scheduler, _ = make(zimage, max_running_requests=8)
    srs = [scheduler.submit(Req(params=p)) for p in ps]
    scheduler.run_until_idle()
    assert max(scheduler.scheduler.batch_size_counts) == 4
    for i, (sr, expected) in enumerate(zip(srs, want, strict=True)):
        assert_same(pixels(sr.req.outputs.images), expected, f"z-image request {i}")


def test_a_request_joins_a_running_batch_mid_way(flux) -> None:
    ps = [params(i, **MIXED[i]) for i in (0, 4, 2)]
    want = [alone(flux, p) for p in ps]
    scheduler, _ = make(flux)
    first = [scheduler.submit(Req(params=p)) for p in ps[:2]]
    scheduler.step()
    scheduler.step()
    assert [sr.req.step_index for sr in first] == [2, 2]
    late = scheduler.submit(Req(params=ps[2]))
    scheduler.run_until_idle()
    assert late.batch_sizes[0] == 3  # it shared its first step with the two already running
    for sr, expected in zip([*first, late], want, strict=True):
        assert_same(pixels(sr.req.outputs.images), expected, f"joined mid-way: {sr.req.params.prompt!r}")


def test_cancelling_mid_batch_frees_the_slot_and_leaves_the_others_unchanged(flux) -> None:
    ps = [params(i, **MIXED[i]) for i in (0, 1, 4, 3)]
    want = [alone(flux, p) for p in ps]
    scheduler, events = make(flux, max_running_requests=3)
    srs = [scheduler.submit(Req(params=p)) for p in ps]
    victim, waiting = srs[1], srs[3]
    victim.req.on_step = lambda req: req.cancel_event.set() if req.step_index == 2 else None
    scheduler.step()
    scheduler.step()
    assert scheduler.scheduler.num_running == 3 and waiting.state == "waiting"
    scheduler.step()  # boundary: the victim leaves, the waiting request takes its slot at once
    assert events.cancelled == [victim.request_id] and victim.req.step_index == 2
    assert waiting.state == "running" and waiting.batch_sizes == [3]
    scheduler.run_until_idle()
    assert victim.req.outputs.images is None and victim.request_id not in events.finished
    for sr, expected in zip(srs, want, strict=True):
        if sr is not victim:
            label = f"next to a cancelled request: {sr.req.params.prompt!r}"
            assert_same(pixels(sr.req.outputs.images), expected, label)


def test_cancelling_a_waiting_request_drops_it(flux) -> None:
    scheduler, events = make(flux, max_running_requests=1)
    a = scheduler.submit(Req(params=params(0, num_inference_steps=2)))
    b = scheduler.submit(Req(params=params(1, num_inference_steps=2)))
    scheduler.step()
    assert scheduler.cancel(b.request_id) == "waiting" and scheduler.cancel("nope") is None
    scheduler.run_until_idle()
    assert events.started == [a.request_id] and b.state == "cancelled"


# -- policy ----------------------------------------------------------------------------------------
def test_two_shape_groups_alternate_fairly(flux) -> None:
    scheduler, _ = make(flux)
    order: list[str] = []
    small = [scheduler.submit(Req(params=params(i, num_inference_steps=4))) for i in range(2)]
    large = [
        scheduler.submit(Req(params=params(i, height=48, width=64, num_inference_steps=4))) for i in (2, 3)
    ]
    for sr in small + large:
        tag = "S" if sr in small else "L"
        sr.req.on_step = lambda req, tag=tag: order.append(tag)
    scheduler.run_until_idle()
    groups = [order[i] for i in range(0, len(order), 2)]  # both members of a group step together
    print("group served per iteration:", "".join(groups), dict(scheduler.scheduler.steps_per_group))
    assert "".join(groups) == "SLSLSLSL"
    assert sorted(scheduler.scheduler.steps_per_group.values()) == [4, 4]
    assert all(sr.batch_sizes == [2] * 4 for sr in small + large)


def test_max_running_requests_is_respected_and_1_runs_one_at_a_time(flux) -> None:
    scheduler, events = make(flux, max_running_requests=2)
    for i in range(5):
        scheduler.submit(Req(params=params(i, num_inference_steps=2 + i % 2)))
    scheduler.run_until_idle()
    assert scheduler.scheduler.max_running_seen == 2 and len(events.finished) == 5
    one, events1 = make(flux, max_running_requests=1)
    srs = [one.submit(Req(params=params(i, num_inference_steps=2))) for i in range(3)]
    one.run_until_idle()
    assert one.scheduler.max_running_seen == 1 and set(one.scheduler.batch_size_counts) == {1}
    assert events1.finished == [sr.request_id for sr in srs]  # FCFS, each completes before the next starts


def test_max_batch_tokens_is_respected(flux) -> None:
    cfg = {"true_cfg_scale": 2.0, "negative_prompt": "bad", "num_inference_steps": 2}
    cost = request_cost(flux, params(0, **cfg))
    assert cost.branches == 2 and cost.tokens == (H // 16) * (W // 16)
    limit = 2 * cost.batch_tokens  # room for two CFG requests
    scheduler, events = make(flux, max_batch_tokens=limit)
    for i in range(5):
        scheduler.submit(Req(params=params(i, **cfg)))
    scheduler.run_until_idle()
    assert scheduler.scheduler.max_running_seen == 2 and len(events.finished) == 5
    assert max(events.tokens_at_start) <= limit  # measured with the new request already in


def test_priority_first_then_fcfs(flux) -> None:
    scheduler, events = make(flux, max_running_requests=1)
    ids = {}
    for name, priority in [("low", 0), ("high", 5), ("mid", 1), ("high2", 5), ("low2", 0)]:
        ids[scheduler.submit(Req(params=params(0, num_inference_steps=1)), priority=priority).request_id] = (
            name
        )
    scheduler.run_until_idle()
    assert [ids[r] for r in events.started] == ["high", "high2", "mid", "low", "low2"]


# -- memory admission ------------------------------------------------------------------------------
def model(budget: int) -> MemoryModel:
    return MemoryModel(
        bytes_per_token=1000.0,
        bytes_per_pixel=10.0,
        fixed_bytes=1e6,
        decode_fixed_bytes=0.0,
        budget_bytes=budget,
        source="measured",
    )


def test_admission_rejects_a_request_that_can_never_fit(flux) -> None:
    memory = model(budget=3_000_000)
    scheduler, _ = make(flux, memory=memory)
    with pytest.raises(RequestTooLargeError) as info:
        scheduler.prepare(Req(params=params(0, height=512, width=512, num_outputs_per_prompt=4)))
    message = str(info.value)
    print(message)
    assert "MB" in message and "budget is 3 MB" in message and "reduce size" in message and "n" in message
    assert "needs an estimated 15 MB" in message  # 1e6 B + 1024 tokens x 4 x 1000 B + 512*512*4*10 B
    assert scheduler.scheduler.num_waiting == 0


def test_memory_budget_keeps_requests_waiting_until_memory_frees(flux) -> None:
    one = request_cost(flux, params(0, num_inference_steps=2))
    memory = model(budget=0)
    memory.budget_bytes = memory.estimate(one) + int(memory.denoise_bytes(one)) - 1  # room for one, not two
    scheduler, events = make(flux, memory=memory)
    for i in range(3):
        scheduler.submit(Req(params=params(i, num_inference_steps=2)))
    scheduler.run_until_idle()
    assert scheduler.scheduler.max_running_seen == 1 and len(events.finished) == 3
    memory.budget_bytes += 1  # now exactly two fit
    for i in range(3):
        scheduler.submit(Req(params=params(i, num_inference_steps=2)))
    scheduler.run_until_idle()
    assert scheduler.scheduler.max_running_seen == 2


# -- failures --------------------------------------------------------------------------------------
class FaultyPipeline:
    """The real pipeline, with a request that fails in its own phase ("boom-pre", "boom-post") and a
    DiT batch that fails whenever it holds a "boom-step" request."""

    def __init__(self, pipeline) -> None:
        self.inner = pipeline
        self.facts = pipeline.facts

    def validate(self, req):
        return self.inner.validate(req)

    def run_pre_denoise(self, req):
        if req.params.prompt == "boom-pre":
            raise RuntimeError("pre-denoise failed")
        return self.inner.run_pre_denoise(req)

    def denoise_step(self, reqs):
        if any(r.params.prompt == "boom-step" for r in reqs):
            raise RuntimeError("the DiT step failed")
        self.inner.denoise_step(reqs)

    def run_post_denoise(self, req):
        if req.params.prompt == "boom-post":
            raise RuntimeError("decoding failed")
        return self.inner.run_post_denoise(req)

    def batch_key(self, req):
        return self.inner.batch_key(req)


def test_failing_requests_do_not_take_down_the_others(flux) -> None:
    good = [params(i, num_inference_steps=3) for i in range(2)]
    want = [alone(flux, p) for p in good]
    scheduler, events = make(flux, FaultyPipeline(flux.pipeline))
    ok = [scheduler.submit(Req(params=p)) for p in good]
    bad = {}
    for prompt in ("boom-pre", "boom-post"):
        bad[prompt] = scheduler.submit(
            Req(params=SamplingParams(prompt=prompt, height=H, width=W, num_inference_steps=2))
        )
    # A different shape: its failing DiT batch fails its own group only.
    bad["boom-step"] = scheduler.submit(
        Req(params=SamplingParams(prompt="boom-step", height=64, width=64, num_inference_steps=2))
    )
    scheduler.run_until_idle()
    assert {events.failed[bad[p].request_id].args[0] for p in bad} == {
        "pre-denoise failed",
        "decoding failed",
        "the DiT step failed",
    }
    assert all(sr.state == "failed" for sr in bad.values()) and scheduler.scheduler.num_running == 0
    for sr, expected in zip(ok, want, strict=True):
        assert sr.state == "finished"
        assert_same(pixels(sr.req.outputs.images), expected, "next to failing requests")


class ScriptedPlatform:
    """A platform whose peak counter reads `denoise(tokens)` / `decode(pixels)` above a 1000-byte
    baseline, in the order a calibration request reads it (baseline, denoise peak after its last step,
    baseline, decode peak read by the engine when the request completes)."""

    name = device_type = "scripted"

    def __init__(self, readings: list[int]) -> None:
        self.readings = readings

    def has_peak_counter(self) -> bool:
        return True

    def peak_counter_is_noisy(self) -> bool:
        """Scripted readings are exact: the two-point fit is kept."""
        return False

    def reset_peak_memory(self) -> None:
        pass

    def bind_device(self) -> None:
        """No device to bind a decode thread to (the engine's decode tasks call it)."""

    def empty_cache(self) -> None:
        pass

    def step_mark(self):
        from diffserve.platforms.cpu import CpuPlatform

        return CpuPlatform().step_mark()

    def synchronize(self) -> None:
        pass

    def memory_info(self):
        from diffserve.platforms.base import MemoryInfo

        peak = self.readings.pop(0) if self.readings else None
        return MemoryInfo(peak_bytes=peak, available_bytes=10**9, total_bytes=2 * 10**9)


def test_calibration_fits_the_measured_peaks(flux) -> None:
    from diffserve.runtime.calibration import calibrate_memory_model

    probes = [
        params(0, height=32, width=32, num_inference_steps=1),
        params(1, height=64, width=64, num_inference_steps=1),
    ]
    readings = []
    for p in probes:  # two runs per probe (PROBE_REPEATS); the fit takes each phase's higher peak
        cost = request_cost(flux, p)
        readings += [1000, 1000 + 500 + 10 * cost.batch_tokens, 1000, 1000 + 7 * cost.pixels]
        readings += [1000, 1000 + 250 + 5 * cost.batch_tokens, 1000, 1000 + 3 * cost.pixels]
    engine = Engine(
        flux.pipeline, ScriptedPlatform(readings), attention_backend=flux.engine.attention_backend
    )
    memory = calibrate_memory_model(engine, probes, mem_fraction=0.5)
    assert memory.source == "measured" and memory.budget_bytes == 5 * 10**8
    assert memory.bytes_per_token == pytest.approx(11.0) and memory.fixed_bytes == pytest.approx(550.0)
    assert memory.bytes_per_pixel == pytest.approx(7.7) and memory.decode_fixed_bytes == pytest.approx(0.0)


def test_an_approximate_tier_counts_its_step_cache_memory(flux) -> None:
    from diffserve.runtime.memory import estimated_memory_model

    exact = request_cost(flux, params(0, num_inference_steps=2))
    medium = request_cost(flux, params(0, num_inference_steps=2, quality="medium"))
    assert not exact.step_cache and medium.step_cache
    memory = estimated_memory_model(flux.pipeline.facts, flux.platform, 0.9)
    width = flux.pipeline.context.get("transformer").inner_dim
    extra = memory.estimate(medium) - memory.estimate(exact)
    assert extra == 2 * width * 4 * medium.batch_tokens  # residual + last signal, fp32
