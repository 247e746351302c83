"""SeaCache's parts (issue 33): the latents on their grid for every family's layout, the spectral indicator
against diffusers' filter, and the gate's decisions against diffusers' `SeaCacheSharedState.resolve_gate`
on the same indicators (the end-to-end comparison is tests/e2e/test_cache_methods_seacache.py)."""

from __future__ import annotations

import pytest
import torch

from diffserve.configs.cache_settings import SeaCacheSettings
from diffserve.families.ltx2.latent_preparation import pack_video_latents
from diffserve.models.cache_methods.base import Plan
from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.cache_methods.seacache import SeaCacheState, sea_indicator
from diffserve.pipelines.cfg_batch import latent_grid
from diffserve.request import LatentSize
from diffserve.stages.latent_preparation import pack_latents

sea_hook = pytest.importorskip("diffusers.hooks.sea_cache", reason="diffusers >= 0.42 ships SeaCache")


def test_latent_grid_reads_every_layout() -> None:
    video = torch.randn(2, 4, 3, 6, 8)
    assert latent_grid(video, LatentSize(6, 8)) is video
    image = torch.randn(2, 4, 6, 8)
    assert torch.equal(latent_grid(image, LatentSize(6, 8)), image.unsqueeze(2))
    assert torch.equal(latent_grid(pack_latents(image), LatentSize(6, 8)), image.unsqueeze(2))  # FLUX, Qwen
    assert torch.equal(latent_grid(pack_video_latents(video), LatentSize(6, 8)), video)  # LTX-2
    tokens = torch.randn(2, 5, 3)  # no grid known: one row of tokens
    assert latent_grid(tokens, None).shape == (2, 3, 1, 1, 5)


@pytest.mark.parametrize("sigma", [0.0, 0.37, 0.93, 1.0])
def test_the_indicator_is_diffusers_filter(sigma: float) -> None:
    grid = torch.randn(2, 4, 3, 6, 8)
    ours = sea_indicator(grid, sigma, 3.0)
    for i in range(2):
        theirs = sea_hook._apply_sea_filter(grid[i].movedim(0, -1), sigma=sigma, power_exp=3.0)
        torch.testing.assert_close(ours[i], theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "settings",
    [
        SeaCacheSettings(),
        SeaCacheSettings(threshold=0.6, max_consecutive_cached=0, retention_steps=2, cache_end_steps=3),
        SeaCacheSettings(threshold=0.3, residual_order=0, max_consecutive_cached=1),
    ],
)
def test_the_gate_decides_as_diffusers(settings: SeaCacheSettings) -> None:
    steps, generator = 24, torch.Generator().manual_seed(0)
    config = sea_hook.SeaCacheConfig(**{k: v for k, v in settings.to_dict().items() if k != "method"})
    shared, context = sea_hook.SeaCacheSharedState(), sea_hook.SeaCacheContextState()
    state = SeaCacheState(settings, num_blocks=4)
    base = torch.randn(2, 1, 6, 8, 4, generator=generator)
    ours, theirs = [], []
    for step in range(steps):
        scale = 0.05 + 0.4 * torch.rand((), generator=generator).item()  # a step's change, some large
        indicator = base + scale * torch.randn(base.shape, generator=generator)
        meta = sea_hook._SeaCacheForwardMetadata(step, 1 - step / steps, steps)
        compute = shared.resolve_gate(context, meta, list(indicator.unbind(0)), config)
        if compute:
            context.consecutive_cached = 0
        else:
            context.consecutive_cached += 1
        theirs.append(compute)

        plan = state.plan(step, steps)
        change = state.measure(indicator) if plan is Plan.MEASURE else None
        reused = plan is Plan.MEASURE and state.decide(float(change), step, steps)
        state.keep_probe(indicator, reused)
        if not reused:
            state.store(Streams(torch.full((1, 2, 3), float(step))), step)
        state.record(reused)
        ours.append(not reused)
        base = indicator
    assert ours == theirs
    assert 0 < sum(ours) < steps


def test_order_one_extrapolates_through_the_last_two_computed_steps() -> None:
    state = SeaCacheState(SeaCacheSettings(), num_blocks=4)
    state.store(Streams(torch.full((1, 2, 3), 1.0)), 2)
    state.store(Streams(torch.full((1, 2, 3), 3.0)), 4)
    assert torch.equal(state.reused_residual(5).image, torch.full((1, 2, 3), 4.0))  # 3 + (3 - 1) * 1/2
    order0 = SeaCacheState(SeaCacheSettings(residual_order=0), num_blocks=4)
    order0.store(Streams(torch.full((1, 2, 3), 1.0)), 2)
    order0.store(Streams(torch.full((1, 2, 3), 3.0)), 4)
    assert len(order0.computed) == 1 and torch.equal(
        order0.reused_residual(5).image, torch.full((1, 2, 3), 3.0)
    )
