"""A request's cancel_event stops it at the next denoising step boundary; on_step reports each step."""

from __future__ import annotations

import threading

import pytest

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import RequestCancelledError
from diffserve.request import Req
from diffserve.stages.denoising import DenoisingStage


def _req(steps: int) -> Req:
    import torch

    req = Req(params=SamplingParams(prompt="x"))
    req.latents = torch.zeros(1)
    req.prompt_embeds = torch.zeros(1)
    req.sigmas = torch.linspace(1, 0, steps + 1)
    req.timesteps = req.sigmas[:-1] * 1000
    return req


def _counting_step(reqs: list[Req]) -> None:
    for r in reqs:
        r.step_index += 1


def test_cancel_between_steps() -> None:
    req = _req(10)
    req.cancel_event = threading.Event()
    seen: list[int] = []

    def on_step(r: Req) -> None:
        seen.append(r.step_index)
        if r.step_index == 3:
            r.cancel_event.set()

    req.on_step = on_step
    with pytest.raises(RequestCancelledError, match="cancelled at step 3"):
        DenoisingStage(_counting_step, show_progress=False)(req)
    assert seen == [1, 2, 3]


def test_uncancelled_request_runs_all_steps() -> None:
    req = _req(4)
    req.cancel_event = threading.Event()
    DenoisingStage(_counting_step, show_progress=False)(req)
    assert req.step_index == 4 and len(req.step_times) == 4
