"""The native SCM scheduler gives Diffusers' SCMScheduler angles and samples, per request, including the step
noise Diffusers draws from the generator (here drawn up front, in the same order)."""

from __future__ import annotations

import pytest
import torch
from diffusers import SCMScheduler as DiffusersSCMScheduler

from diffserve.families.sana.tiny import SANA_SPRINT_SCHEDULER_CONFIG
from diffserve.models.schedulers.scm import SCMScheduler

SHAPE = (2, 8, 5, 6)
MAX_ANGLE, INTERMEDIATE_ANGLE = 1.57080, 1.3


def _fake_model(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return 0.3 * sample + torch.cos(t) * noise


def _diffusers_run(steps: int, intermediate: float | None, seed: int) -> torch.Tensor:
    ref = DiffusersSCMScheduler(sigma_data=0.5)
    ref.set_timesteps(steps, max_timesteps=MAX_ANGLE, intermediate_timesteps=intermediate)
    ref.set_begin_index(0)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=generator) * 0.5
    guide = torch.linspace(-1, 1, x.numel()).view(SHAPE)
    for t in ref.timesteps[:-1]:
        x = ref.step(_fake_model(x, t, guide), t, x, generator=generator).prev_sample
    return x


@pytest.mark.parametrize(
    ("steps", "intermediate"), [(2, INTERMEDIATE_ANGLE), (1, None), (2, None), (4, None)]
)
def test_sampling_equals_diffusers(steps: int, intermediate: float | None) -> None:
    mine = SCMScheduler.from_config(SANA_SPRINT_SCHEDULER_CONFIG)
    ref = DiffusersSCMScheduler(sigma_data=0.5)
    ref.set_timesteps(steps, max_timesteps=MAX_ANGLE, intermediate_timesteps=intermediate)
    schedule = mine.schedule(steps, MAX_ANGLE, intermediate)
    assert torch.equal(schedule.sigmas, ref.timesteps)
    assert torch.equal(schedule.timesteps, ref.timesteps[:-1])

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, generator=generator) * 0.5
    state = mine.new_state(mine.draw_noise(generator, steps, SHAPE))
    guide = torch.linspace(-1, 1, x.numel()).view(SHAPE)
    for i, t in enumerate(schedule.timesteps):
        x = mine.step(_fake_model(x, t, guide), x, schedule.sigmas, i, state)
    assert torch.equal(x, _diffusers_run(steps, intermediate, seed=3))
    assert torch.equal(state.model_outputs[-1], x)  # the last step lands on its clean prediction


def test_released_config_keys_are_accepted_and_bad_input_refused() -> None:
    mine = SCMScheduler.from_config({"_class_name": "SCMScheduler", **SANA_SPRINT_SCHEDULER_CONFIG})
    assert mine.config["sigma_data"] == 0.5 and mine.config["max_timesteps"] == MAX_ANGLE
    with pytest.raises(ValueError, match="unknown"):
        SCMScheduler.from_config({"not_a_key": 1})
    with pytest.raises(ValueError, match="trigflow"):
        SCMScheduler.from_config({"prediction_type": "epsilon"})
    with pytest.raises(ValueError, match="two-step"):
        mine.schedule(3, MAX_ANGLE, INTERMEDIATE_ANGLE)
    with pytest.raises(ValueError, match="noise"):
        mine.new_state()
    schedule = mine.schedule(2, MAX_ANGLE, INTERMEDIATE_ANGLE)
    state = mine.new_state(torch.zeros(2, *SHAPE))
    x = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match="consecutive"):
        mine.step(x, mine.step(x, x, schedule.sigmas, 0, state), schedule.sigmas, 0, state)
