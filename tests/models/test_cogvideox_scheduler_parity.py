"""Native CogVideoX DDIM and DPM schedulers against Diffusers' on a stand-in model: the same timesteps for
every spacing, and the same samples after a whole loop (DPM drawing its noise from the same generator)."""

from __future__ import annotations

import pytest
import torch

from diffserve.models.schedulers.cogvideox_ddim import CogVideoXDDIMScheduler, CogVideoXDPMScheduler
from diffserve.testing.parity import assert_parity, fake_flow_model

diffusers = pytest.importorskip("diffusers")

#: The released CogVideoX-5b scheduler config (CogVideoX-2b: snr_shift_scale 3.0, epsilon... as defaults).
RELEASED_5B = {
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "set_alpha_to_one": True,
    "snr_shift_scale": 1.0,
    "timestep_spacing": "trailing",
}
CONFIGS = [
    RELEASED_5B,
    {"timestep_spacing": "leading", "steps_offset": 1},
    {"timestep_spacing": "linspace", "prediction_type": "sample", "set_alpha_to_one": False},
    {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing", "prediction_type": "v_prediction"},
]


def _loop(
    native, reference, steps: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both samplers over `steps` steps on the stand-in model, the samples kept in `dtype` between steps and
    the model output in float32, as the CogVideoX pipelines do."""
    start = torch.randn(2, 3, 4, 5, 6, generator=torch.Generator().manual_seed(seed)).to(dtype)
    noise = torch.randn(start.shape, generator=torch.Generator().manual_seed(seed + 1))
    dpm = isinstance(native, CogVideoXDPMScheduler)
    reference.set_timesteps(steps)
    timesteps = native.timesteps(steps)
    assert torch.equal(timesteps, reference.timesteps)
    ours, theirs = start.clone(), start.clone()
    g_ours, g_theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    state, old = native.new_state(), None
    for i, t in enumerate(reference.timesteps):
        out_theirs = fake_flow_model(theirs.float(), t, noise)
        out_ours = fake_flow_model(ours.float(), t, noise)
        if dpm:
            back = reference.timesteps[i - 1] if i > 0 else None
            theirs, old = reference.step(
                out_theirs, old, t, back, theirs, generator=g_theirs, return_dict=False
            )
        else:
            theirs = reference.step(out_theirs, t, theirs, return_dict=False)[0]
        ours = native.step(out_ours, ours, timesteps.tolist(), i, state, generator=g_ours)
        theirs, ours = theirs.to(dtype), ours.to(dtype)
    return ours, theirs


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("steps", [1, 4, 9])
def test_ddim_matches(config, steps: int) -> None:
    ours, theirs = _loop(
        CogVideoXDDIMScheduler(**config), diffusers.CogVideoXDDIMScheduler(**config), steps, steps
    )
    assert_parity(ours, theirs, f"cogvideox ddim {config} {steps} steps", min_db=100.0)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("steps", [1, 4, 9])
def test_dpm_matches(config, steps: int) -> None:
    ours, theirs = _loop(
        CogVideoXDPMScheduler(**config), diffusers.CogVideoXDPMScheduler(**config), steps, steps
    )
    assert_parity(ours, theirs, f"cogvideox dpm {config} {steps} steps", min_db=100.0)


@pytest.mark.parametrize("sampler", ["CogVideoXDDIMScheduler", "CogVideoXDPMScheduler"])
@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        (RELEASED_5B, torch.bfloat16),  # the coefficients times bfloat16 latents: a bfloat16 product
        ({"prediction_type": "epsilon"}, torch.bfloat16),  # a division by a float64 0-dim coefficient
        ({"beta_schedule": "linear", "rescale_betas_zero_snr": True}, torch.float32),  # float32 alphas
    ],
    ids=["released-5b-bf16", "epsilon-bf16", "linear-float32"],
)
def test_samplers_equal_diffusers_bit_for_bit(sampler: str, config: dict, dtype: torch.dtype) -> None:
    """The coefficients are 0-dim CPU tensors of Diffusers' dtypes, applied as Diffusers applies them: the
    same rounding whatever the schedule's dtype and the latents'."""
    native_cls = CogVideoXDPMScheduler if sampler.endswith("DPMScheduler") else CogVideoXDDIMScheduler
    ours, theirs = _loop(native_cls(**config), getattr(diffusers, sampler)(**config), 4, 3, dtype)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


def test_unknown_config_key_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        CogVideoXDDIMScheduler.from_config({"thresholding": True})
