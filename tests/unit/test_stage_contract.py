"""The Stage base class: declared needs are checked before a stage runs, declared sets after,
and every stage run is timed into the request, waiting for the platform it is given."""

from __future__ import annotations

import pytest
import torch

from diffserve.configs.sampling_params import SamplingParams
from diffserve.platforms import CpuPlatform
from diffserve.request import Req
from diffserve.stages.base import Stage, StageContractError


class SetsLatents(Stage):
    needs = ("prompt_embeds",)
    sets = ("latents",)

    def forward(self, req: Req) -> Req:
        req.latents = torch.zeros(1)
        return req


class ForgetsToSet(Stage):
    sets = ("latents",)

    def forward(self, req: Req) -> Req:
        return req


def _req() -> Req:
    return Req(params=SamplingParams(prompt="x"))


def test_missing_need_is_reported_before_running() -> None:
    with pytest.raises(StageContractError, match="SetsLatents needs prompt_embeds"):
        SetsLatents()(_req(), CpuPlatform())


def test_unset_promise_is_reported() -> None:
    with pytest.raises(StageContractError, match="ForgetsToSet did not set latents"):
        ForgetsToSet()(_req(), CpuPlatform())


def test_stage_is_timed_into_the_request() -> None:
    req = _req()
    req.prompt_embeds = torch.zeros(1)
    req = SetsLatents()(req, CpuPlatform())
    assert req.latents is not None
    assert "SetsLatents" in req.timings.stages and req.timings.stages["SetsLatents"] >= 0


class CountingPlatform(CpuPlatform):
    def __init__(self) -> None:
        self.synchronize_calls = 0

    def synchronize(self, index: int = 0) -> None:
        self.synchronize_calls += 1


def test_stage_timing_waits_for_the_platform_it_is_given() -> None:
    """The stage's time includes its device work: the clock stops after that platform's synchronize."""
    mine, other = CountingPlatform(), CountingPlatform()
    req = _req()
    req.prompt_embeds = torch.zeros(1)
    SetsLatents()(req, mine)
    assert (mine.synchronize_calls, other.synchronize_calls) == (1, 0)


def test_sampling_params_defaults_fill_only_unset_fields() -> None:
    defaults = SamplingParams(height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5)
    mine = SamplingParams(prompt="a", height=512, num_inference_steps=None)
    resolved = mine.with_defaults(defaults)
    assert (resolved.height, resolved.width, resolved.num_inference_steps, resolved.guidance_scale) == (
        512,
        1024,
        28,
        3.5,
    )
    assert mine.width is None, "with_defaults must not modify the request's own params"
