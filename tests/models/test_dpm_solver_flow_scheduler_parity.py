"""The native DPM-Solver++ flow scheduler gives Diffusers' schedules and sampling trajectories, per request.

The sampling loops drive both schedulers with the same deterministic fake "model" (a fixed function of
the sample and the timestep), so any difference in a single update compounds into the final sample.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from diffserve.models.schedulers.dpm_solver_flow import DPM_SOLVER_CONFIG_DEFAULTS, DPMSolverFlowScheduler

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
    ref = DPMSolverMultistepScheduler.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    return ref, DPMSolverFlowScheduler.from_config(config)


def _fake_model(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return 0.3 * sample + torch.cos(t.to(torch.float32) / 1000) * noise


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)


def _run_diffusers(ref: DPMSolverMultistepScheduler, steps: int, latents: torch.Tensor, noise: torch.Tensor):
    ref.set_timesteps(steps)
    x = latents
    for t in ref.timesteps:
        x = ref.step(_fake_model(x, t, noise), t, x).prev_sample
    return x


def _run_native(mine: DPMSolverFlowScheduler, steps: int, latents: torch.Tensor, noise: torch.Tensor):
    schedule = mine.schedule(steps)
    state = mine.new_state()
    x = latents
    for i, t in enumerate(schedule.timesteps):
        x = mine.step(_fake_model(x, t, noise), x, schedule.sigmas, i, state)
    return x


def test_every_diffusers_config_key_is_accepted() -> None:
    params = inspect.signature(DPMSolverMultistepScheduler.__init__).parameters
    diffusers_keys = {k for k in params if k != "self"}
    assert diffusers_keys == set(DPM_SOLVER_CONFIG_DEFAULTS)
    for key, default in DPM_SOLVER_CONFIG_DEFAULTS.items():
        assert params[key].default == default, key
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
    expected = _run_diffusers(ref, steps, latents, noise)
    got = _run_native(mine, steps, latents, noise)
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
    ref.set_timesteps(steps)
    schedule = mine.schedule(steps)
    state = mine.new_state()
    x_ref = x = latents
    for i, t in enumerate(ref.timesteps):
        x_ref = ref.step(_fake_model(x_ref, t, noise), t, x_ref).prev_sample
        x = mine.step(_fake_model(x, schedule.timesteps[i], noise), x, schedule.sigmas, i, state)
        assert torch.equal(x, x_ref), f"step {i}"


def test_mixed_precision_equals_diffusers() -> None:
    """float32 latents with a bfloat16 model output: the same promotions as Diffusers."""
    ref, mine = _pair(solver_order=3)
    latents, noise = _inputs(2)
    ref.set_timesteps(6)
    schedule = mine.schedule(6)
    state = mine.new_state()
    x_ref = x = latents
    for i, t in enumerate(ref.timesteps):
        x_ref = ref.step(_fake_model(x_ref, t, noise).bfloat16(), t, x_ref).prev_sample
        x = mine.step(_fake_model(x, t, noise).bfloat16(), x, schedule.sigmas, i, state)
    assert x.dtype == x_ref.dtype
    assert torch.equal(x, x_ref)


def test_interleaved_requests_match_solo_runs() -> None:
    """Two requests at different steps share one scheduler object; each sees only its own history."""
    mine = DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "solver_order": 3})
    lat_a, noise_a = _inputs(10)
    lat_b, noise_b = _inputs(11)
    solo_a = _run_native(mine, 12, lat_a, noise_a)
    solo_b = _run_native(mine, 7, lat_b, noise_b)
    sched_a, sched_b = mine.schedule(12), mine.schedule(7)
    state_a, state_b = mine.new_state(), mine.new_state()
    x_a, x_b = lat_a, lat_b
    i_a = i_b = 0
    for _ in range(3):
        x_a = mine.step(_fake_model(x_a, sched_a.timesteps[i_a], noise_a), x_a, sched_a.sigmas, i_a, state_a)
        i_a += 1
    while i_a < 12 or i_b < 7:
        if i_b < 7:
            t = sched_b.timesteps[i_b]
            x_b = mine.step(_fake_model(x_b, t, noise_b), x_b, sched_b.sigmas, i_b, state_b)
            i_b += 1
        if i_a < 12:
            t = sched_a.timesteps[i_a]
            x_a = mine.step(_fake_model(x_a, t, noise_a), x_a, sched_a.sigmas, i_a, state_a)
            i_a += 1
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
    x = mine.step(_fake_model(x, schedule.timesteps[0], noise), x, schedule.sigmas, 0, state)
    with pytest.raises(ValueError, match="consecutive"):
        mine.step(noise, x, schedule.sigmas, 2, state)
    with pytest.raises(ValueError, match="outside"):
        mine.step(noise, x, schedule.sigmas, 5, mine.new_state())
