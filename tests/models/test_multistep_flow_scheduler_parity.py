"""The native multistep flow schedulers (DPM-Solver++ for SANA, UniPC for Wan) give Diffusers' schedules and
sampling trajectories, per request.

The sampling loops drive both schedulers with the same deterministic fake "model" (a fixed function of
the sample and the timestep), so any difference in a single update compounds into the final sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler

from diffserve.models.schedulers.dpm_solver_flow import DPM_SOLVER_CONFIG_DEFAULTS, DPMSolverFlowScheduler
from diffserve.models.schedulers.unipc_flow import UNIPC_CONFIG_DEFAULTS, UniPCFlowScheduler
from diffserve.testing.parity import (
    assert_parity,
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
#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json.
WAN_CONFIG = {
    "_class_name": "UniPCMultistepScheduler",
    "_diffusers_version": "0.33.0.dev0",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


@dataclass(frozen=True)
class Solver:
    reference: type
    native: Any
    #: The native class's config defaults (must be Diffusers' constructor defaults).
    defaults: dict[str, Any]
    #: The released scheduler_config.json.
    config: dict[str, Any]
    steps: tuple[int, ...]
    shifts: tuple[float, ...]
    shape: tuple[int, ...]
    #: Diffusers' `set_begin_index` for a loop from the first step (UniPC's pipelines set it).
    begin_index: int | None
    #: Sampling variants (config overrides) and their step counts.
    variants: list[dict[str, Any]]
    variant_steps: tuple[int, ...]


SOLVERS = {
    "dpm": Solver(
        DPMSolverMultistepScheduler, DPMSolverFlowScheduler, DPM_SOLVER_CONFIG_DEFAULTS, SANA_CONFIG,
        steps=(1, 2, 3, 5, 14, 15, 20), shifts=(1.0, 3.0, 4.5), shape=(2, 8, 6, 5), begin_index=None,
        variants=[
            {"solver_type": "heun"},
            {"solver_type": "heun", "solver_order": 3},
            {"lower_order_final": False, "solver_order": 3},
            {"euler_at_final": True},
            {"solver_type": "bh2"},
            # Diffusers' dynamic shift: a mu sets the shift to exp(mu); a variance type is read for epsilon
            # predictions only; an order above 3 takes third-order updates.
            {"use_dynamic_shifting": True},
            {"solver_order": 4, "variance_type": "learned_range"},
        ],
        variant_steps=(4, 16),
    ),
    "unipc": Solver(
        UniPCMultistepScheduler, UniPCFlowScheduler, UNIPC_CONFIG_DEFAULTS, WAN_CONFIG,
        # (batch, channels, frames, height, width): a small video latent
        steps=(1, 2, 3, 5, 10, 30), shifts=(1.0, 3.0, 5.0), shape=(2, 4, 3, 5, 6), begin_index=0,
        variants=[
            {"solver_type": "bh1", "final_sigmas_type": "sigma_min"},
            {"final_sigmas_type": "sigma_min", "lower_order_final": False},
            {"final_sigmas_type": "sigma_min", "solver_order": 3},
            {"disable_corrector": [0, 3]},
            {"solver_order": 3, "use_dynamic_shifting": True},
        ],
        variant_steps=(8,),
    ),
}  # fmt: skip


def _pair(solver: str, **overrides: object) -> tuple[Any, Any]:
    spec = SOLVERS[solver]
    config = {**spec.config, **overrides}
    return diffusers_scheduler(spec.reference, config), spec.native.from_config(config)


def _inputs(solver: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return latents_and_noise(SOLVERS[solver].shape, seed)


SCHEDULES = [(name, steps, shift) for name, s in SOLVERS.items() for shift in s.shifts for steps in s.steps]
SAMPLING = [(name, order, steps, shift) for name, steps, shift in SCHEDULES for order in (1, 2, 3)]
VARIANTS = [(name, v, steps) for name, s in SOLVERS.items() for steps in s.variant_steps for v in s.variants]


@pytest.mark.parametrize("solver", SOLVERS)
def test_every_diffusers_config_key_is_accepted(solver: str) -> None:
    spec = SOLVERS[solver]
    assert diffusers_init_defaults(spec.reference) == spec.defaults
    spec.native.from_config(spec.config)


@pytest.mark.parametrize(("solver", "steps", "shift"), SCHEDULES)
def test_schedule_equals_diffusers(solver: str, steps: int, shift: float) -> None:
    ref, mine = _pair(solver, flow_shift=shift)
    ref.set_timesteps(steps)
    schedule = mine.schedule(steps)
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert ref.timesteps.dtype == torch.int64
    assert torch.equal(schedule.timesteps, ref.timesteps.to(torch.float32))
    assert schedule.num_steps == steps


@pytest.mark.parametrize(("solver", "solver_order", "steps", "shift"), SAMPLING)
def test_sampling_loop_equals_diffusers(solver: str, solver_order: int, steps: int, shift: float) -> None:
    ref, mine = _pair(solver, flow_shift=shift, solver_order=solver_order)
    latents, noise = _inputs(solver)
    expected = sample_with_diffusers(ref, steps, latents, noise, begin_index=SOLVERS[solver].begin_index)
    got = sample_natively(mine, steps, latents, noise)
    assert torch.isfinite(got).all()
    assert_parity(got, expected, f"{solver} order={solver_order} steps={steps} shift={shift}", max_abs=1e-5)
    assert torch.equal(got, expected)  # same operations in the same order: bit-identical


@pytest.mark.parametrize(("solver", "overrides", "steps"), VARIANTS)
def test_sampling_loop_variants_equal_diffusers(solver: str, overrides: dict, steps: int) -> None:
    ref, mine = _pair(solver, **overrides)
    mu = 0.7 if overrides.get("use_dynamic_shifting") else None
    latents, noise = _inputs(solver, 1)
    lockstep = sample_in_lockstep(
        ref, mine, steps, latents, noise, mu=mu, begin_index=SOLVERS[solver].begin_index
    )
    for i, x_ref, x in lockstep:
        assert torch.equal(x, x_ref), f"step {i}"


def _bf16_model(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return fake_flow_model(sample, t, noise).bfloat16()


@pytest.mark.parametrize("solver", SOLVERS)
def test_mixed_precision_equals_diffusers(solver: str) -> None:
    """float32 latents with a bfloat16 model output (as Wan's pipeline feeds): the same promotions as
    Diffusers."""
    ref, mine = _pair(solver, solver_order=3)
    latents, noise = _inputs(solver, 2)
    *_, (_, x_ref, x) = sample_in_lockstep(
        ref, mine, 6, latents, noise, begin_index=SOLVERS[solver].begin_index, model=_bf16_model,
        reference_timesteps=True,
    )  # fmt: skip
    assert x.dtype == x_ref.dtype == torch.float32
    assert torch.equal(x, x_ref)


@pytest.mark.parametrize("solver", SOLVERS)
def test_interleaved_requests_match_solo_runs(solver: str) -> None:
    """Two requests at different steps share one scheduler object; each sees only its own history."""
    ref, mine = _pair(solver, solver_order=3)
    lat_a, noise_a = _inputs(solver, 10)
    lat_b, noise_b = _inputs(solver, 11)
    solo_a = sample_natively(mine, 12, lat_a, noise_a)
    solo_b = sample_natively(mine, 7, lat_b, noise_b)
    # A runs ahead for 3 steps, then both alternate, so they sit at different steps throughout.
    x_a, x_b = sample_interleaved(mine, [(12, lat_a, noise_a), (7, lat_b, noise_b)], head_start=3)
    assert torch.equal(x_a, solo_a)
    assert torch.equal(x_b, solo_b)
    begin_index = SOLVERS[solver].begin_index
    assert torch.equal(x_a, sample_with_diffusers(ref, 12, lat_a, noise_a, begin_index=begin_index))


@pytest.mark.parametrize("solver", SOLVERS)
def test_out_of_order_steps_are_refused(solver: str) -> None:
    _, mine = _pair(solver)
    schedule = mine.schedule(5)
    state = mine.new_state()
    x, noise = _inputs(solver)
    x = mine.step(fake_flow_model(x, schedule.timesteps[0], noise), x, schedule.sigmas, 0, state)
    with pytest.raises(ValueError, match="consecutive"):
        mine.step(noise, x, schedule.sigmas, 2, state)
    with pytest.raises(ValueError, match="outside"):
        mine.step(noise, x, schedule.sigmas, 5, mine.new_state())


@pytest.mark.parametrize("solver", SOLVERS)
def test_unknown_and_unsupported_options_are_refused(solver: str) -> None:
    native, config = SOLVERS[solver].native, SOLVERS[solver].config
    with pytest.raises(ValueError, match="unknown"):
        native.from_config({**config, "not_an_option": 1})
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        native.from_config({"prediction_type": "flow_prediction"})
    with pytest.raises(ValueError, match="prediction_type"):
        native.from_config({**config, "prediction_type": "epsilon"})
    for key in ("use_karras_sigmas", "thresholding"):
        with pytest.raises(ValueError, match=key):
            native.from_config({**config, key: True})


# ----------------------------------------------------------------------------------- DPM-Solver++


def test_unsupported_dpm_options_are_refused() -> None:
    with pytest.raises(ValueError, match="use_dynamic_shifting"):  # Diffusers asserts it for a mu
        DPMSolverFlowScheduler.from_config(SANA_CONFIG).schedule(4, mu=0.5)
    with pytest.raises(ValueError, match="exponential"):
        DPMSolverFlowScheduler.from_config(
            {**SANA_CONFIG, "use_dynamic_shifting": True, "time_shift_type": "linear"}
        ).schedule(4, mu=0.5)
    with pytest.raises(ValueError, match="sigmas"):
        DPMSolverFlowScheduler.from_config(SANA_CONFIG).schedule(4, sigmas=[1.0, 0.7, 0.4, 0.1])
    for algorithm in ("sde-dpmsolver++", "dpmsolver", "deis"):  # Diffusers refuses the last two with "zero"
        with pytest.raises(ValueError, match="algorithm_type"):
            DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "algorithm_type": algorithm})
    with pytest.raises(ValueError, match="final_sigmas_type"):
        DPMSolverFlowScheduler.from_config({**SANA_CONFIG, "final_sigmas_type": "sigma_min"})


# ------------------------------------------------------------------------------------------ UniPC


@pytest.mark.parametrize(
    "overrides",
    [
        {"final_sigmas_type": "sigma_min"},
        {"use_dynamic_shifting": True},
        {"use_dynamic_shifting": True, "time_shift_type": "linear"},
        {"shift_terminal": 0.1},
    ],
)
def test_unipc_schedule_variants_equal_diffusers(overrides: dict) -> None:
    ref, mine = _pair("unipc", **overrides)
    mu = 1.3 if overrides.get("use_dynamic_shifting") else None
    ref.set_timesteps(7, mu=mu)
    schedule = mine.schedule(7, mu=mu)
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert torch.equal(schedule.timesteps, ref.timesteps.to(torch.float32))


def test_unipc_one_step_with_shift_terminal_is_finite() -> None:
    """Diffusers stretches 1 - sigma so the last sigma lands on shift_terminal; a one-step schedule ends at
    sigma 1, where that divides 0 by 0 (NaN samples). As FlowMatchEulerScheduler, UniPC leaves it
    unstretched; longer schedules are Diffusers' (test_unipc_schedule_variants_equal_diffusers)."""
    ref, mine = _pair("unipc", shift_terminal=0.1)
    ref.set_timesteps(1)
    assert torch.isnan(ref.sigmas[0])
    schedule = mine.schedule(1)
    unstretched = _pair("unipc")[1].schedule(1)
    assert torch.equal(schedule.sigmas, unstretched.sigmas)
    assert torch.equal(schedule.timesteps, unstretched.timesteps)
    latents, noise = _inputs("unipc")
    assert torch.isfinite(sample_natively(mine, 1, latents, noise)).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_unipc_custom_sigmas_equal_diffusers(dtype: type) -> None:
    ref, mine = _pair("unipc")
    base = np.linspace(1.0, 0.05, 6).astype(dtype)
    ref.set_timesteps(sigmas=base.copy())
    schedule = mine.schedule(6, sigmas=base.copy())
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert torch.equal(schedule.timesteps, ref.timesteps.to(torch.float32))


def test_unipc_img2img_start_mid_schedule_equals_diffusers() -> None:
    ref, mine = _pair("unipc")
    latents, noise = _inputs("unipc", 3)
    *_, (_, x_ref, x) = sample_in_lockstep(
        ref, mine, 10, latents, noise, start=4, begin_index=4, reference_timesteps=True
    )
    assert torch.equal(x, x_ref)


def test_unsupported_unipc_options_are_refused() -> None:
    with pytest.raises(ValueError, match="predict_x0"):
        UniPCFlowScheduler.from_config({**WAN_CONFIG, "predict_x0": False})
    with pytest.raises(ValueError, match="bh1"):
        UniPCFlowScheduler.from_config({**WAN_CONFIG, "solver_type": "bh1"})
    with pytest.raises(ValueError, match="lower_order_final"):
        UniPCFlowScheduler.from_config({**WAN_CONFIG, "lower_order_final": False})
    with pytest.raises(ValueError, match="lower_order_final"):
        UniPCFlowScheduler.from_config(
            {**WAN_CONFIG, "lower_order_final": False, "final_sigmas_type": "sigma_min", "solver_order": 3}
        )
    with pytest.raises(ValueError, match="mu"):
        UniPCFlowScheduler.from_config({**WAN_CONFIG, "use_dynamic_shifting": True}).schedule(4)
    assert (
        UniPCFlowScheduler.from_config({**WAN_CONFIG, "solver_type": "midpoint"}).config["solver_type"]
        == "bh2"
    )
