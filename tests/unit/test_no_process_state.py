"""Two generators in one process do not share an attention backend or a platform.

The attention backend is active only inside a scope on the thread that entered it; the engine enters
its own around its model calls. Platforms are plain objects handed to whoever needs one (stages,
CustomOps, the engine), with no process-wide "current" platform. flash_attn and sageattention need CUDA,
so the tests replace their kernels with fakes whose outputs say which backend ran: what is checked is
the dispatch decision, which is what two generators could get wrong.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import pytest
import torch

import diffserve.layers.attention as attention_mod
import diffserve.platforms as platforms
from diffserve.configs.sampling_params import SamplingParams
from diffserve.layers.attention import (
    AttentionBackend,
    active_attention_backend,
    attention,
    attention_backend_scope,
)
from diffserve.layers.custom_op import CustomOp
from diffserve.platforms import CpuPlatform, resolve_platform
from diffserve.request import Req
from diffserve.runtime import Engine, SchedulerConfig
from diffserve.stages.base import Stage
from diffserve.testing.fake_pipeline import FakePipeline

#: The value each faked fast backend fills its output with (SDPA's outputs are never exactly these).
MARK = {AttentionBackend.FLASH_ATTN: 7.0, AttentionBackend.SAGE_ATTN: 9.0}
TIMEOUT_S = 30.0


@pytest.fixture(autouse=True)
def fake_fast_kernels(monkeypatch) -> None:
    """The kernel table's flash_attn and sage_attn entries replaced by fakes that take any call."""
    for backend, mark in MARK.items():
        fake = dataclasses.replace(
            attention_mod.SPECS[backend],
            call_unsupported=lambda q, k, v, mask: None,
            run=lambda q, k, v, mask, mark=mark: torch.full_like(q, mark),
        )
        monkeypatch.setitem(attention_mod.SPECS, backend, fake)


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 5, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3))  # type: ignore[return-value]


def backend_that_ran(out: torch.Tensor) -> AttentionBackend:
    """Which backend produced `out` (the fakes fill it with their mark; anything else is SDPA)."""
    for backend, mark in MARK.items():
        if torch.all(out == mark):
            return backend
    return AttentionBackend.SDPA


def run_in_threads(*targets: Callable[[], None]) -> None:
    """Run the targets concurrently and re-raise the first error any of them hit."""
    errors: list[BaseException] = []

    def wrap(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001  (re-raised on the test's thread)
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


# --- attention backend ---------------------------------------------------------------------------


def test_two_threads_in_different_scopes_each_run_their_own_backend() -> None:
    q, k, v = qkv()
    both_inside = threading.Barrier(2, timeout=TIMEOUT_S)
    seen: dict[AttentionBackend, list[AttentionBackend]] = {}

    def generator(backend: AttentionBackend) -> Callable[[], None]:
        def run() -> None:
            with attention_backend_scope(backend):
                both_inside.wait()  # the other thread's scope is entered too from here on
                seen[backend] = [backend_that_ran(attention(q, k, v)) for _ in range(20)]
                both_inside.wait()

        return run

    run_in_threads(generator(AttentionBackend.FLASH_ATTN), generator(AttentionBackend.SAGE_ATTN))
    assert seen[AttentionBackend.FLASH_ATTN] == [AttentionBackend.FLASH_ATTN] * 20
    assert seen[AttentionBackend.SAGE_ATTN] == [AttentionBackend.SAGE_ATTN] * 20
    # This thread entered no scope: neither thread's backend leaked into it.
    assert active_attention_backend() is AttentionBackend.SDPA
    assert backend_that_ran(attention(q, k, v)) is AttentionBackend.SDPA


def test_compiled_code_reads_the_scope_when_it_runs_not_when_it_is_traced() -> None:
    """Blocks of two generators share compiled code (same code object). The graph must not bake in the
    backend it was traced under, and reading the scope must not break the graph."""
    q, k, v = qkv()
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q * 1, k, v) + 0

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=counting_backend, fullgraph=True)
    with attention_backend_scope(AttentionBackend.FLASH_ATTN):  # traced under flash_attn
        assert backend_that_ran(compiled(q, k, v)) is AttentionBackend.FLASH_ATTN
    seen: dict[AttentionBackend, AttentionBackend] = {}

    def generator(backend: AttentionBackend) -> Callable[[], None]:
        def run() -> None:
            with attention_backend_scope(backend):
                seen[backend] = backend_that_ran(compiled(q, k, v))

        return run

    run_in_threads(generator(AttentionBackend.SAGE_ATTN), generator(AttentionBackend.SDPA))
    assert seen == {
        AttentionBackend.SAGE_ATTN: AttentionBackend.SAGE_ATTN,
        AttentionBackend.SDPA: AttentionBackend.SDPA,
    }
    assert len(graphs) == 1, "a backend change must not recompile: one graph serves every scope"
    torch._dynamo.reset()


class RecordingPipeline(FakePipeline):
    """A fake pipeline whose every phase runs attention and records the backend that ran."""

    def __init__(self, both_stepping: threading.Barrier) -> None:
        super().__init__()
        self.both_stepping = both_stepping
        self.ran: dict[str, set[AttentionBackend]] = {}

    def _attend(self, phase: str) -> None:
        self.ran.setdefault(phase, set()).add(backend_that_ran(attention(*qkv())))

    def validate(self, req: Req) -> Req:
        self._attend("validate")
        return super().validate(req)

    def run_pre_denoise(self, req: Req) -> Req:
        self._attend("pre_denoise")
        return super().run_pre_denoise(req)

    def denoise_step(self, reqs: list[Req]) -> None:
        self.both_stepping.wait()  # the two engines step in lockstep, each on its own thread
        self._attend("denoise_step")
        super().denoise_step(reqs)

    def run_post_denoise(self, req: Req) -> Req:
        self._attend("post_denoise")
        return super().run_post_denoise(req)


def test_two_engines_on_two_threads_run_their_models_with_their_own_backend() -> None:
    both_stepping = threading.Barrier(2, timeout=TIMEOUT_S)
    engines = {
        backend: Engine(
            RecordingPipeline(both_stepping),
            CpuPlatform(),
            SchedulerConfig(max_batch_tokens=16384),
            attention_backend=backend,
        )  # fmt: skip
        for backend in (AttentionBackend.FLASH_ATTN, AttentionBackend.SAGE_ATTN)
    }
    hooks: dict[AttentionBackend, set[AttentionBackend]] = {backend: set() for backend in engines}

    def generate(backend: AttentionBackend) -> Callable[[], None]:
        def run() -> None:
            req = Req(params=SamplingParams(prompt="a red fox", num_inference_steps=3))
            # An event hook on the driving thread (the server decodes previews there) runs in the scope too.
            req.on_step = lambda r: hooks[backend].add(backend_that_ran(attention(*qkv())))
            sr = engines[backend].submit(req)
            engines[backend].run_to_completion([sr])
            assert sr.state == "finished", sr.error

        return run

    run_in_threads(*(generate(backend) for backend in engines))
    for backend, engine in engines.items():
        pipeline = engine.pipeline
        assert isinstance(pipeline, RecordingPipeline)
        assert pipeline.ran == {
            phase: {backend} for phase in ("validate", "pre_denoise", "denoise_step", "post_denoise")
        }
        assert hooks[backend] == {backend}
    assert active_attention_backend() is AttentionBackend.SDPA


# --- platform ------------------------------------------------------------------------------------


class CountingCpuPlatform(CpuPlatform):
    """A CPU platform that counts the synchronize calls made on this instance."""

    def __init__(self, dispatch_key: str = "cpu") -> None:
        self.dispatch_key = dispatch_key
        self.synchronize_calls = 0

    def synchronize(self, index: int = 0) -> None:
        self.synchronize_calls += 1


class Noop(Stage):
    def forward(self, req: Req) -> Req:
        return req


class Kernel(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward_musa(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_there_is_no_process_wide_platform_or_backend_to_set() -> None:
    for name in ("current_platform", "set_platform", "_current"):
        assert not hasattr(platforms, name)
    for name in ("select_attention_backend", "selected_attention_backend", "_selected"):
        assert not hasattr(attention_mod, name)


def test_resolving_a_platform_twice_gives_two_independent_instances() -> None:
    first, second = resolve_platform("cpu"), resolve_platform("cpu")
    assert type(first) is CpuPlatform and type(second) is CpuPlatform
    assert first is not second


def test_two_platforms_time_their_own_stages_on_two_threads() -> None:
    mine, other = CountingCpuPlatform(), CountingCpuPlatform()
    both_running = threading.Barrier(2, timeout=TIMEOUT_S)

    def pipeline(platform: CountingCpuPlatform, runs: int) -> Callable[[], None]:
        def run() -> None:
            both_running.wait()
            for _ in range(runs):
                Noop()(Req(params=SamplingParams(prompt="x")), platform)

        return run

    run_in_threads(pipeline(mine, 5), pipeline(other, 3))
    assert (mine.synchronize_calls, other.synchronize_calls) == (5, 3)


def test_ops_built_for_two_platforms_keep_their_own_dispatch() -> None:
    accelerator, cpu = CountingCpuPlatform("musa"), CountingCpuPlatform("cpu")
    on_accelerator, on_cpu = Kernel(accelerator), Kernel(cpu)
    x = torch.zeros(2)
    assert torch.equal(on_accelerator(x), x + 1) and torch.equal(on_cpu(x), x)
    assert on_accelerator.dispatch_platform is accelerator and on_cpu.dispatch_platform is cpu
    assert Kernel(CpuPlatform()).dispatched_method_name == "forward_cpu"  # building another moves neither
    assert on_accelerator.dispatched_method_name == "forward_musa"
