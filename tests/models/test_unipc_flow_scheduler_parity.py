"""The native UniPC flow scheduler gives Diffusers' schedules and sampling trajectories, per request.

The sampling loops drive both schedulers with the same deterministic fake "model" (a fixed
function of the sample and the timestep), so any difference in a single update compounds into
the final sample.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler

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

STEPS = (1, 2, 3, 5, 10, 30)
SHIFTS = (1.0, 3.0, 5.0)
SHAPE = (2, 4, 3, 5, 6)  # (batch, channels, frames, height, width): a small video latent


def _pair(**overrides: object) -> tuple[UniPCMultistepScheduler, UniPCFlowScheduler]:
    config = {**WAN_CONFIG, **overrides}
    return diffusers_scheduler(UniPCMultistepScheduler, config), UniPCFlowScheduler.from_config(config)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return latents_and_noise(SHAPE, seed)


def test_every_diffusers_config_key_is_accepted() -> None:
    assert diffusers_init_defaults(UniPCMultistepScheduler) == UNIPC_CONFIG_DEFAULTS
    UniPCFlowScheduler.from_config(WAN_CONFIG)


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


@pytest.mark.parametrize(
    "overrides",
    [
        {"final_sigmas_type": "sigma_min"},
        {"use_dynamic_shifting": True},
        {"use_dynamic_shifting": True, "time_shift_type": "linear"},
        {"shift_terminal": 0.1},
    ],
)
def test_schedule_variants_equal_diffusers(overrides: dict) -> None:
    ref, mine = _pair(**overrides)
    mu = 1.3 if overrides.get("use_dynamic_shifting") else None
    ref.set_timesteps(7, mu=mu)
    schedule = mine.schedule(7, mu=mu)
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert torch.equal(schedule.timesteps, ref.timesteps.to(torch.float32))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_custom_sigmas_equal_diffusers(dtype: type) -> None:
    ref, mine = _pair()
    base = np.linspace(1.0, 0.05, 6).astype(dtype)
    ref.set_timesteps(sigmas=base.copy())
    schedule = mine.schedule(6, sigmas=base.copy())
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert torch.equal(schedule.timesteps, ref.timesteps.to(torch.float32))


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("solver_order", [1, 2, 3])
def test_sampling_loop_equals_diffusers(solver_order: int, steps: int, shift: float) -> None:
    ref, mine = _pair(flow_shift=shift, solver_order=solver_order)
    latents, noise = _inputs()
    expected = sample_with_diffusers(ref, steps, latents, noise, begin_index=0)
    got = sample_natively(mine, steps, latents, noise)
    assert torch.isfinite(got).all()
    assert_parity(got, expected, f"order={solver_order} steps={steps} shift={shift}", max_abs=1e-5)
    assert torch.equal(got, expected)  # same operations in the same order: bit-identical


@pytest.mark.parametrize(
    "overrides",
    [
        {"solver_type": "bh1", "final_sigmas_type": "sigma_min"},
        {"final_sigmas_type": "sigma_min", "lower_order_final": False},
        {"final_sigmas_type": "sigma_min", "solver_order": 3},
        {"disable_corrector": [0, 3]},
        {"solver_order": 3, "use_dynamic_shifting": True},
    ],
)
def test_sampling_loop_variants_equal_diffusers(overrides: dict) -> None:
    ref, mine = _pair(**overrides)
    mu = 0.7 if overrides.get("use_dynamic_shifting") else None
    latents, noise = _inputs(1)
    for i, x_ref, x in sample_in_lockstep(ref, mine, 8, latents, noise, mu=mu, begin_index=0):
        assert torch.equal(x, x_ref), f"step {i}"


def _bf16_model(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return fake_flow_model(sample, t, noise).bfloat16()


def test_mixed_precision_equals_diffusers() -> None:
    """Wan's pipeline keeps float32 latents and feeds a bfloat16 model output: same promotions here."""
    ref, mine = _pair(solver_order=3)
    latents, noise = _inputs(2)
    *_, (_, x_ref, x) = sample_in_lockstep(
        ref, mine, 6, latents, noise, begin_index=0, model=_bf16_model, reference_timesteps=True
    )
    assert x.dtype == torch.float32
    assert torch.equal(x, x_ref)


def test_img2img_start_mid_schedule_equals_diffusers() -> None:
    ref, mine = _pair()
    latents, noise = _inputs(3)
    *_, (_, x_ref, x) = sample_in_lockstep(
        ref, mine, 10, latents, noise, start=4, begin_index=4, reference_timesteps=True
    )
    assert torch.equal(x, x_ref)


def test_interleaved_requests_match_solo_runs() -> None:
    """Two requests at different steps share one scheduler object; each sees only its own history."""
    mine = UniPCFlowScheduler.from_config({**WAN_CONFIG, "solver_order": 3})
    lat_a, noise_a = _inputs(10)
    lat_b, noise_b = _inputs(11)
    solo_a = sample_natively(mine, 12, lat_a, noise_a)
    solo_b = sample_natively(mine, 7, lat_b, noise_b)
    # A runs ahead for 3 steps, then both alternate, so they sit at different steps throughout.
    x_a, x_b = sample_interleaved(mine, [(12, lat_a, noise_a), (7, lat_b, noise_b)], head_start=3)
    assert torch.equal(x_a, solo_a)
    assert torch.equal(x_b, solo_b)
    ref, _ = _pair(solver_order=3)
    assert torch.equal(x_a, sample_with_diffusers(ref, 12, lat_a, noise_a, begin_index=0))


def test_unknown_and_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        UniPCFlowScheduler.from_config({**WAN_CONFIG, "not_an_option": 1})
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        UniPCFlowScheduler.from_config({"prediction_type": "flow_prediction"})
    with pytest.raises(ValueError, match="prediction_type"):
        UniPCFlowScheduler.from_config({**WAN_CONFIG, "prediction_type": "epsilon"})
    for key in ("use_karras_sigmas", "thresholding"):
        with pytest.raises(ValueError, match=key):
            UniPCFlowScheduler.from_config({**WAN_CONFIG, key: True})
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


def test_out_of_order_steps_are_refused() -> None:
    mine = UniPCFlowScheduler.from_config(WAN_CONFIG)
    schedule = mine.schedule(5)
    state = mine.new_state()
    x, noise = _inputs()
    x = mine.step(fake_flow_model(x, schedule.timesteps[0], noise), x, schedule.sigmas, 0, state)
    with pytest.raises(ValueError, match="consecutive"):
        mine.step(noise, x, schedule.sigmas, 2, state)
    with pytest.raises(ValueError, match="outside"):
        mine.step(noise, x, schedule.sigmas, 5, mine.new_state())
