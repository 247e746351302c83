"""The native DPM-Solver++ flow scheduler gives Diffusers' schedules and sampling trajectories, per request.

The sampling loops drive both schedulers with the same deterministic fake "model" (a fixed function of
the sample and the timestep), so any difference in a single update compounds into the final sample.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from diffserve.models.schedulers.dpm_solver_flow import DPM_SOLVER_CONFIG_DEFAULTS, DPMSolverFlowScheduler
from diffserve.testing.parity import (
    diffusers_init_defaults,
    diffusers_scheduler,
    fake_flow_model,
    latents_and_noise,
    sample_in_lockstep,
    sample_interleaved,
    sample_natively,
    sample_with_diffusers,
)

#: What SANA's conversion script writes (scripts/convert_sana_to_diffusers.py, "flow-dpm_solver"): the
#: Diffusers defaults plus the flow path. The 1024px models use flow_shift 3.
SANA_CONFIG = {
    "_class_name": "DPMSolverMultistepScheduler",
    "_diffusers_version": "0.32.0.dev0",
    "flow_shift": 3.0,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
}

STEPS = (1, 2, 3, 5, 14, 15, 20)
SHIFTS = (1.0, 3.0, 4.5)
SHAPE = (2, 8, 6, 5)


def _pair(**overrides: object) -> tuple[DPMSolverMultistepScheduler, DPMSolverFlowScheduler]:
    config = {**SANA_CONFIG, **overrides}
    return diffusers_scheduler(DPMSolverMultistepScheduler, config), DPMSolverFlowScheduler.from_config(
        config
    )


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return latents_and_noise(SHAPE, seed)


def test_every_diffusers_config_key_is_accepted() -> None:
    assert diffusers_init_defaults(DPMSolverMultistepScheduler) == DPM_SOLVER_CONFIG_DEFAULTS
    DPMSolverFlowScheduler.from_config(SANA_CONFIG)


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
def test_schedule_equals_diffusers(steps: int, shift: float) -> None:
    ref, mine = _pair(flow_shift=shift)
    ref.set_timesteps(steps)
    schedule = mine.schedule(steps)
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert ref.timesteps.dtype == torch.int64
    assert torch.equal(schedule.timesteps, ref.timesteps.to(torch.float32))
    assert schedule.num_steps == steps


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("solver_order", [1, 2, 3])
def test_sampling_loop_equals_diffusers(solver_order: int, steps: int, shift: float) -> None:
    ref, mine = _pair(flow_shift=shift, solver_order=solver_order)
    latents, noise = _inputs()
    expected = sample_with_diffusers(ref, steps, latents, noise)
    got = sample_natively(mine, steps, latents, noise)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)  # same operations in the same order: bit-identical


@pytest.mark.parametrize(
    "overrides",
    [
        {"solver_type": "heun"},
        {"solver_type": "heun", "solver_order": 3},
        {"lower_order_final": False, "solver_order": 3},
        {"euler_at_final": True},
        {"solver_type": "bh2"},
    ],
)
@pytest.mark.parametrize("steps", [4, 16])
def test_sampling_loop_variants_equal_diffusers(overrides: dict, steps: int) -> None:
    ref, mine = _pair(**overrides)
    latents, noise = _inputs(1)
    for i, x_ref, x in sample_in_lockstep(ref, mine, steps, latents, noise):
        assert torch.equal(x, x_ref), f"step {i}"


def _bf16_model(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return fake_flow_model(sample, t, noise).bfloat16()


def test_mixed_precision_equals_diffusers() -> None:
    """float32 latents with a bfloat16 model output: the same promotions as Diffusers."""
    ref, mine = _pair(solver_order=3)
    latents, noise = _inputs(2)
    *_, (_, x_ref, x) = sample_in_lockstep(
        ref, mine, 6, latents, noise, model=_bf16_model, reference_timesteps=True
    )
    assert x.dtype == x_ref.dtype
    assert torch.equal(x, x_ref)


def test_interleaved_requests_match_solo_runs() -> None:
    """Two requests at different steps share one scheduler object; each sees only its own history."""
    mine = DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "solver_order": 3})
    lat_a, noise_a = _inputs(10)
    lat_b, noise_b = _inputs(11)
    solo_a = sample_natively(mine, 12, lat_a, noise_a)
    solo_b = sample_natively(mine, 7, lat_b, noise_b)
    # A runs ahead for 3 steps, then both alternate, so they sit at different steps throughout.
    x_a, x_b = sample_interleaved(mine, [(12, lat_a, noise_a), (7, lat_b, noise_b)], head_start=3)
    assert torch.equal(x_a, solo_a)
    assert torch.equal(x_b, solo_b)


def test_unknown_and_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "not_an_option": 1})
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        DPMSolverFlowScheduler.from_config({"prediction_type": "flow_prediction"})
    with pytest.raises(ValueError, match="prediction_type"):
        DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "prediction_type": "epsilon"})
    for key in ("use_karras_sigmas", "thresholding", "use_dynamic_shifting"):
        with pytest.raises(ValueError, match=key):
            DPMSolverFlowScheduler.from_config({**SANA_CONFIG, key: True})
    for algorithm in ("sde-dpmsolver++", "dpmsolver", "deis"):  # Diffusers refuses the last two with "zero"
        with pytest.raises(ValueError, match="algorithm_type"):
            DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "algorithm_type": algorithm})
    with pytest.raises(ValueError, match="final_sigmas_type"):
        DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "final_sigmas_type": "sigma_min"})
    with pytest.raises(ValueError, match="mu"):
        DPMSolverFlowScheduler.from_config(SANA_CONFIG).schedule(4, mu=0.5)


def test_out_of_order_steps_are_refused() -> None:
    mine = DPMSolverFlowScheduler.from_config(SANA_CONFIG)
    schedule = mine.schedule(5)
    state = mine.new_state()
    x, noise = _inputs()
    x = mine.step(fake_flow_model(x, schedule.timesteps[0], noise), x, schedule.sigmas, 0, state)
    with pytest.raises(ValueError, match="consecutive"):
        mine.step(noise, x, schedule.sigmas, 2, state)
    with pytest.raises(ValueError, match="outside"):
        mine.step(noise, x, schedule.sigmas, 5, mine.new_state())
