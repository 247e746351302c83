"""A request's cancel_event stops it at the next denoising step boundary; on_step reports each step."""

from __future__ import annotations

import threading

from diffserve.configs.sampling_params import SamplingParams
from diffserve.layers.attention import AttentionBackend
from diffserve.platforms.cpu import CpuPlatform
from diffserve.request import Req
from diffserve.runtime import Engine
from diffserve.testing.fake_pipeline import FakePipeline


def _engine() -> Engine:
    return Engine(FakePipeline(), CpuPlatform(), attention_backend=AttentionBackend.SDPA)


def test_cancel_between_steps() -> None:
    engine = _engine()
    seen: list[int] = []

    def on_step(r: Req) -> None:
        seen.append(r.step_index)
        if r.step_index == 3:
            r.cancel_event.set()

    sr = engine.submit(Req(params=SamplingParams(prompt="x", num_inference_steps=10), on_step=on_step))
    engine.run_to_completion([sr])
    assert sr.state == "cancelled" and sr.req.step_index == 3 and seen == [1, 2, 3]
    assert sr.req.outputs.images is None  # never decoded


def test_cancel_from_another_thread_while_waiting() -> None:
    engine = _engine()
    sr = engine.submit(Req(params=SamplingParams(prompt="x"), cancel_event=threading.Event()))
    canceller = threading.Thread(target=engine.cancel, args=(sr.request_id,))
    canceller.start()
    canceller.join()
    assert sr.done.is_set()  # a waiting request ends at once
    engine.run_to_completion([sr])
    assert sr.state == "cancelled" and sr.req.step_index == 0


def test_uncancelled_request_runs_all_steps() -> None:
    engine = _engine()
    sr = engine.submit(Req(params=SamplingParams(prompt="x", num_inference_steps=4)))
    engine.run_to_completion([sr])
    assert sr.state == "finished" and sr.req.step_index == 4 and len(sr.req.timings.steps) == 4
