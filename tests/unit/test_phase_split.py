"""A request's phases run apart (phases.py, runtime/handoff.py; the engines of `serve --ray --disaggregate`):
encode, denoise and decode run as three engine requests with the request packed into a `Handoff` between
them (pickled, as it crosses processes) give the pixels of the one-call generation, bit for bit (a tiny
FLUX.1 with true CFG, and a tiny Wan's video frames); requests that arrive encoded still share DiT
batches; what a hand-off clears and what it refuses."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import numpy as np
import pytest

from diffserve.api import DiffGenerator
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.phases import WHOLE, Handoff, PhaseSpan
from diffserve.request import Req
from diffserve.runtime.handoff import pack_handoff, unpack_handoff

SIZE, STEPS = 64, 3


@pytest.fixture(scope="module")
def generator(tiny_flux_dir):
    args = EngineArgs(model_path=str(tiny_flux_dir), batch_policy="throughput")
    gen = DiffGenerator(args, show_progress=False, memory_model=False)
    yield gen
    gen.close()


def params(seed: int, prompt: str = "a red fox") -> SamplingParams:
    """True CFG on: the negative branch's fields cross too."""
    return SamplingParams(
        prompt, negative_prompt="blurry", true_cfg_scale=2.0, height=SIZE, width=SIZE,
        num_inference_steps=STEPS, seed=seed,
    )  # fmt: skip


def run_phase(gen: DiffGenerator, reqs: list[Req], span: PhaseSpan) -> list:
    """Run `span` of every request in `reqs` through the engine, together; their scheduled requests."""
    scheduled = [gen.engine.submit(req, span=span) for req in reqs]
    gen.engine.run_to_completion(scheduled)
    for sr in scheduled:
        assert sr.state == "finished", sr.error
    return scheduled


def shipped(handoff: Handoff) -> Handoff:
    """The hand-off as another process receives it."""
    return pickle.loads(pickle.dumps(handoff))


def in_phases(gen: DiffGenerator, seeds: list[int], make: Callable[[int], SamplingParams] = params) -> list:
    """Encode, denoise and decode each request as separate engine requests, hand-offs between them."""
    device = gen.platform.device()
    encoded = run_phase(gen, [Req(params=make(seed)) for seed in seeds], PhaseSpan.only("encode"))
    handoffs = [shipped(pack_handoff(sr.req, "denoise")) for sr in encoded]
    denoised = run_phase(gen, [unpack_handoff(h, device) for h in handoffs], PhaseSpan.only("denoise"))
    handoffs = [shipped(pack_handoff(sr.req, "decode")) for sr in denoised]
    decoded = run_phase(gen, [unpack_handoff(h, device) for h in handoffs], PhaseSpan.only("decode"))
    return [denoised, decoded]


def test_phases_apart_equal_one_call(generator):
    whole = np.asarray(generator.generate_from_params(params(7)).images[0])
    [denoised], [decoded] = in_phases(generator, [7])
    assert np.array_equal(np.asarray(decoded.req.outputs.images[0]), whole)
    assert denoised.batch_sizes == [1] * STEPS
    assert len(decoded.req.timings.steps) == STEPS  # the step times travel with the request
    assert decoded.req.params.seed == 7


def test_video_phases_apart_equal_one_call(tmp_path):
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    folder = build_tiny_wan(tmp_path / "tiny-wan", TinyWanSpec())
    with DiffGenerator(EngineArgs(model_path=str(folder)), show_progress=False, memory_model=False) as gen:

        def video(seed: int) -> SamplingParams:
            return SamplingParams(
                "a red fox running", height=32, width=32, num_frames=5, num_inference_steps=2, seed=seed
            )

        whole = gen.generate_from_params(video(4)).frames[0]
        _, [decoded] = in_phases(gen, [4], video)
    np.testing.assert_array_equal(decoded.req.outputs.frames[0], whole)


def test_encoded_requests_share_dit_batches(generator):
    """Two requests that arrive encoded run their steps as one DiT batch, and each gets its own image."""
    alone = [np.asarray(generator.generate_from_params(params(seed)).images[0]) for seed in (1, 2)]
    denoised, decoded = in_phases(generator, [1, 2])
    assert [sr.batch_sizes for sr in denoised] == [[2] * STEPS] * 2
    for sr, image in zip(decoded, alone, strict=True):
        got = np.asarray(sr.req.outputs.images[0]).astype(int)
        assert np.abs(got - image.astype(int)).max() <= 1  # a batch of two may round differently


def test_handoff_clears_what_stays_with_its_engine(generator):
    [denoised], _ = in_phases(generator, [3])
    req = denoised.req
    assert req.dit_context is not None  # the DiT's embedded text, kept by the denoising engine
    req.on_step = print
    arrived = unpack_handoff(shipped(pack_handoff(req, "decode")), generator.platform.device())
    assert arrived.dit_context is None and arrived.on_step is None and arrived.cancel_event is None
    assert arrived.is_denoised and arrived.latents.shape == req.latents.shape
    assert arrived.negative_prompt_embeds is not None


def test_handoff_refuses_a_request_not_ready():
    with pytest.raises(ValueError, match="has not been encoded"):
        pack_handoff(Req(params=params(1)), "denoise")
    with pytest.raises(ValueError, match="to denoise or decode"):
        pack_handoff(Req(params=params(1)), "encode")


def test_phase_spans():
    assert WHOLE.whole and WHOLE.next_phase is None
    span = PhaseSpan.only("denoise")
    assert span.runs("denoise") and not span.runs("encode") and span.next_phase == "decode"
    assert str(PhaseSpan("encode", "denoise")) == "encode-denoise"
    with pytest.raises(ValueError, match="runs forward"):
        PhaseSpan("decode", "encode")
    with pytest.raises(ValueError, match="unknown phase"):
        PhaseSpan("upscale", "decode")  # type: ignore[arg-type]
