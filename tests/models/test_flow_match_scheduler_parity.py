"""The native flow-match scheduler gives the same sigmas, timesteps and Euler updates as Diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler

FLUX_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
SD3_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}


def _diffusers_flux_mu(image_seq_len: int) -> float:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)


@pytest.mark.parametrize("steps", [1, 4, 28, 50])
@pytest.mark.parametrize("image_seq_len", [16, 256, 1024, 4096])
def test_flux_schedule_equals_diffusers(steps: int, image_seq_len: int) -> None:
    ref = FlowMatchEulerDiscreteScheduler(**FLUX_CONFIG)
    mine = FlowMatchEulerScheduler.from_config({"_class_name": "x", **FLUX_CONFIG})
    mu = mine.resolution_shift_mu(image_seq_len)
    assert mu == pytest.approx(_diffusers_flux_mu(image_seq_len), abs=0, rel=1e-15)
    base = np.linspace(1.0, 1 / steps, steps)
    ref.set_timesteps(sigmas=base, mu=mu)
    schedule = mine.schedule(steps, mu=mu, sigmas=base)
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert torch.equal(schedule.timesteps, ref.timesteps)


@pytest.mark.parametrize("steps", [2, 20])
def test_static_shift_schedule_equals_diffusers(steps: int) -> None:
    ref = FlowMatchEulerDiscreteScheduler(**SD3_CONFIG)
    mine = FlowMatchEulerScheduler.from_config(SD3_CONFIG)
    ref.set_timesteps(steps)
    schedule = mine.schedule(steps)
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert torch.equal(schedule.timesteps, ref.timesteps)


QWEN_LIKE_CONFIG = {
    **FLUX_CONFIG, "base_shift": 0.5, "max_shift": 0.9, "shift_terminal": 0.02, "time_shift_type": "exponential",
}  # fmt: skip
MOCHI_LIKE_CONFIG = {"num_train_timesteps": 1000, "shift": 1.0, "invert_sigmas": True}


@pytest.mark.parametrize("spacing", ["use_karras_sigmas", "use_exponential_sigmas"])
@pytest.mark.parametrize(
    ("config", "custom_sigmas"),
    [(FLUX_CONFIG, True), (QWEN_LIKE_CONFIG, True), (SD3_CONFIG, False), (SD3_CONFIG, True), (MOCHI_LIKE_CONFIG, False)],
    ids=["flux", "qwen-like", "sd3", "sd3-custom-sigmas", "mochi-like"],
)  # fmt: skip
@pytest.mark.parametrize("steps", [1, 3, 28])
def test_karras_and_exponential_spacing_equals_diffusers(spacing, config, custom_sigmas, steps) -> None:
    """The re-spaced schedules (after the shift and the terminal stretch, before inversion), bit for bit."""
    config = {**config, spacing: True}
    ref = FlowMatchEulerDiscreteScheduler(**config)
    mine = FlowMatchEulerScheduler.from_config(config)
    mu = 0.7 if config.get("use_dynamic_shifting") else None
    base = np.linspace(1.0, 1 / steps, steps) if custom_sigmas else None
    if base is None:
        ref.set_timesteps(steps, mu=mu)
    else:
        ref.set_timesteps(sigmas=base, mu=mu)
    schedule = mine.schedule(steps, mu=mu, sigmas=base)
    if steps > 1:
        assert not torch.equal(schedule.sigmas, FlowMatchEulerScheduler.from_config({**config, spacing: False}).schedule(steps, mu=mu, sigmas=base).sigmas)  # fmt: skip
    if config.get("shift_terminal") and steps == 1:
        return  # diffusers' one-step stretch divides 0 by 0 (test_one_step_with_shift_terminal_is_finite)
    assert torch.equal(schedule.sigmas, ref.sigmas)
    assert torch.equal(schedule.timesteps, ref.timesteps)


def test_two_sigma_spacings_are_refused_as_diffusers_refuses_them() -> None:
    with pytest.raises(ValueError, match="only one of"):
        FlowMatchEulerScheduler.from_config(
            {**SD3_CONFIG, "use_karras_sigmas": True, "use_exponential_sigmas": True}
        )
    with pytest.raises(ValueError, match="use_beta_sigmas"):
        FlowMatchEulerScheduler.from_config({**SD3_CONFIG, "use_beta_sigmas": True})


def test_euler_step_equals_diffusers_per_sample() -> None:
    ref = FlowMatchEulerDiscreteScheduler(**FLUX_CONFIG)
    base = np.linspace(1.0, 1 / 6, 6)
    ref.set_timesteps(sigmas=base, mu=0.8)
    mine = FlowMatchEulerScheduler.from_config(FLUX_CONFIG)
    schedule = mine.schedule(6, mu=0.8, sigmas=base)
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 12, 8, generator=gen)
    output = torch.randn(2, 12, 8, generator=gen)
    # Sample 0 at step 2, sample 1 at step 4: each must equal Diffusers' step at that index.
    idx = [2, 4]
    batched = mine.step(output, sample, schedule.sigmas[idx], schedule.sigmas[[i + 1 for i in idx]])
    for row, i in enumerate(idx):
        ref.set_timesteps(sigmas=base, mu=0.8)
        ref.set_begin_index(i)
        expected = ref.step(output[row : row + 1], ref.timesteps[i], sample[row : row + 1]).prev_sample
        assert torch.equal(batched[row : row + 1], expected)


@pytest.mark.parametrize(
    ("sample_dtype", "output_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_half_precision_euler_step_equals_diffusers(sample_dtype, output_dtype) -> None:
    """Diffusers' `dt * model_output` stays in a bfloat16/float16 output's dtype (dt a 0-dim tensor) before
    it is added to the float32 sample: the native step rounds it the same way, bit for bit."""
    ref = FlowMatchEulerDiscreteScheduler(**SD3_CONFIG)
    ref.set_timesteps(3)
    ref.set_begin_index(0)
    schedule = FlowMatchEulerScheduler.from_config(SD3_CONFIG).schedule(3)
    gen = torch.Generator().manual_seed(1)
    x_ref = x = torch.randn(2, 16, 24, generator=gen).to(sample_dtype)
    for i, t in enumerate(ref.timesteps):
        output = torch.randn(2, 16, 24, generator=gen).to(output_dtype)
        x_ref = ref.step(output, t, x_ref).prev_sample
        x = FlowMatchEulerScheduler.step(output, x, schedule.sigmas[[i, i]], schedule.sigmas[[i + 1, i + 1]])
        assert x.dtype == x_ref.dtype == output_dtype
        assert torch.equal(x, x_ref), f"step {i}"


def test_unknown_and_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        FlowMatchEulerScheduler.from_config({"not_an_option": 1})
    with pytest.raises(ValueError, match="stochastic_sampling"):
        FlowMatchEulerScheduler.from_config({"stochastic_sampling": True})
    with pytest.raises(ValueError, match="mu"):
        FlowMatchEulerScheduler.from_config(FLUX_CONFIG).schedule(4)


def test_one_step_with_shift_terminal_is_finite() -> None:
    """Diffusers stretches 1 - sigma so the last sigma lands on shift_terminal; with one step that
    divides 0 by 0 (NaN, a black image). diffserve leaves a one-step schedule unstretched."""
    scheduler = FlowMatchEulerScheduler.from_config(
        {
            "use_dynamic_shifting": True,
            "shift_terminal": 0.02,
            "time_shift_type": "exponential",
            "base_shift": 0.5,
            "max_shift": 0.9,
            "base_image_seq_len": 256,
            "max_image_seq_len": 8192,
        }
    )
    schedule = scheduler.schedule(1, mu=0.7, sigmas=[1.0])
    assert torch.isfinite(schedule.sigmas).all()
    assert schedule.sigmas.tolist() == [1.0, 0.0]
