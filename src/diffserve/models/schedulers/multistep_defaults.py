"""The config keys and defaults that Diffusers' `DPMSolverMultistepScheduler` and
`UniPCMultistepScheduler` share: both are multistep solvers over the same beta/sigma schedule options,
so a config missing one of these keys means the same default for either. Each scheduler adds its own
solver keys on top (`DPM_SOLVER_CONFIG_DEFAULTS`, `UNIPC_CONFIG_DEFAULTS`).
"""

from __future__ import annotations

from typing import Any

MULTISTEP_CONFIG_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "solver_order": 2,
    "prediction_type": "epsilon",
    "thresholding": False,
    "dynamic_thresholding_ratio": 0.995,
    "sample_max_value": 1.0,
    "lower_order_final": True,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_flow_sigmas": False,
    "flow_shift": 1.0,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
    "steps_offset": 0,
    "rescale_betas_zero_snr": False,
    "use_dynamic_shifting": False,
    "time_shift_type": "exponential",
}
