"""DPM-Solver++ multistep sampler on the flow-matching path (Diffusers' `DPMSolverMultistepScheduler`
configured as SANA ships it: `use_flow_sigmas=True`, `prediction_type="flow_prediction"`, `flow_shift`).

DPM-Solver++ (Lu et al., 2022) integrates the diffusion ODE in the log-SNR variable
`lambda = log(alpha) - log(sigma)` using data predictions; on the flow path `alpha = 1 - sigma`. Each
call to `step` at schedule index `i`:

1. turns the velocity prediction into a data prediction, `x0 = sample - sigma_i * v`, and pushes it
   onto the request's history (the last `solver_order` data predictions);
2. moves the sample from `sigma_i` to `sigma_{i+1}` with the first-, second- or third-order multistep
   update, the order warming up from 1 and dropping back to 1 (and 2) at the end of short schedules
   as Diffusers decides (`lower_order_final`, `euler_at_final`, `final_sigmas_type="zero"`).

Diffusers keeps the step index and that history on the scheduler, tying one scheduler to one
request. Here the scheduler holds configuration only: `schedule` computes a request's sigmas,
`new_state` makes its history, and `step` advances one request's rows given its sigmas, step index and
state, so requests at different steps share one scheduler. The scalar coefficients are computed as
Diffusers computes them, from the CPU copy of the sigmas as 0-d float32 tensors, in the same order of
operations, so samples match Diffusers bit for bit; a step makes no host transfer and no host sync.

Only the deterministic `dpmsolver++` algorithm on the flow path is implemented (what SANA uses); the
other algorithm types, the non-flow noise schedules and thresholding are refused when a config asks
for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar

import numpy as np
import torch

from diffserve.models.config_keys import checked_config_kwargs
from diffserve.models.schedulers.flow_match_euler import SigmaSchedule
from diffserve.models.schedulers.multistep_defaults import MULTISTEP_CONFIG_DEFAULTS
from diffserve.models.schedulers.step_order import check_history_length, checked_step_count

#: Diffusers' `DPMSolverMultistepScheduler` config keys and their defaults (a config missing a key
#: means the Diffusers default).
DPM_SOLVER_CONFIG_DEFAULTS: dict[str, Any] = {
    **MULTISTEP_CONFIG_DEFAULTS,
    "algorithm_type": "dpmsolver++",
    "solver_type": "midpoint",
    "euler_at_final": False,
    "use_lu_lambdas": False,
    "lambda_min_clipped": -float("inf"),
    "variance_type": None,
}

#: Diffusers maps these solver names of other multistep solvers onto "midpoint".
_MIDPOINT_ALIASES = ("logrho", "bh1", "bh2")
#: Below this many steps, `lower_order_final` also lowers the last two steps' order (Diffusers' rule).
_SHORT_SCHEDULE = 15


@dataclass
class DPMSolverState:
    """One request's solver history between `step` calls (what Diffusers keeps on the scheduler).

    `model_outputs` holds the last `solver_order` data predictions, oldest first (`None` until
    filled); `lower_order_nums` counts the updates taken so far, up to `solver_order`.
    """

    model_outputs: list[torch.Tensor | None]
    lower_order_nums: int = 0
    last_step_index: int | None = None


class DPMSolverFlowScheduler:
    """DPM-Solver++ multistep sampler for flow-matching models. Stateless across requests."""

    diffusers_class_name: ClassVar[str] = "DPMSolverMultistepScheduler"

    def __init__(self, **config: Any) -> None:
        """Keyword arguments are Diffusers' config keys (`DPM_SOLVER_CONFIG_DEFAULTS`); missing ones take
        Diffusers' defaults, except that the flow path is the point of this class: `use_flow_sigmas` and
        `prediction_type` must say so (SANA's folders do)."""
        unknown = sorted(set(config) - set(DPM_SOLVER_CONFIG_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown DPMSolverMultistepScheduler options {unknown}")
        cfg = {**DPM_SOLVER_CONFIG_DEFAULTS, **config}
        if not cfg["use_flow_sigmas"]:
            raise ValueError(
                "DPMSolverFlowScheduler implements only the flow path: use_flow_sigmas must be True"
            )
        if cfg["prediction_type"] != "flow_prediction":
            raise ValueError(f"prediction_type must be 'flow_prediction', got {cfg['prediction_type']!r}")
        if cfg["algorithm_type"] != "dpmsolver++":
            raise ValueError(
                f"algorithm_type {cfg['algorithm_type']!r} is not supported: only the deterministic "
                "'dpmsolver++' (what SANA uses)"
            )
        if cfg["solver_type"] in _MIDPOINT_ALIASES:
            cfg["solver_type"] = "midpoint"
        if cfg["solver_type"] not in ("midpoint", "heun"):
            raise ValueError(f"solver_type must be 'midpoint' or 'heun', got {cfg['solver_type']!r}")
        for key in (
            "thresholding",
            "use_karras_sigmas",
            "use_exponential_sigmas",
            "use_beta_sigmas",
            "use_lu_lambdas",
        ):
            if cfg[key]:
                raise ValueError(f"scheduler option {key}=True is not supported by diffserve yet")
        if cfg["final_sigmas_type"] != "zero":
            # Diffusers' "sigma_min" ends a flow schedule on the VP noise level of its beta schedule.
            raise ValueError(f"final_sigmas_type must be 'zero', got {cfg['final_sigmas_type']!r}")
        if int(cfg["solver_order"]) < 1:
            raise ValueError(f"solver_order must be >= 1, got {cfg['solver_order']}")
        # The beta-schedule keys, timestep_spacing, steps_offset, lambda_min_clipped and variance_type (read
        # for epsilon predictions only) only feed Diffusers' non-flow paths: accepted and recorded, not used.
        # An order above 3 takes third-order updates, as in Diffusers. use_dynamic_shifting only matters
        # with a `mu` (`schedule`).
        cfg["solver_order"] = int(cfg["solver_order"])
        self.config: dict[str, Any] = cfg
        self.solver_order: int = cfg["solver_order"]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DPMSolverFlowScheduler:
        """Build from a Diffusers `scheduler_config.json` dict; missing keys take Diffusers' defaults."""
        return cls(**checked_config_kwargs(config, DPM_SOLVER_CONFIG_DEFAULTS, cls.diffusers_class_name))

    # ----------------------------------------------------------------------------------- schedule

    def schedule(
        self, num_steps: int, mu: float | None = None, sigmas: np.ndarray | list[float] | None = None
    ) -> SigmaSchedule:
        """The sigmas (a final 0 appended) and model timesteps for `num_steps` steps, as Diffusers'
        `set_timesteps(num_steps, mu=mu)`: a linear ramp shifted by `flow_shift` (by `exp(mu)` when `mu` is
        given, which Diffusers allows only with use_dynamic_shifting and the exponential time shift), computed
        in float64; sigmas are stored as float32, timesteps as `sigma * num_train_timesteps` truncated to
        integers (Diffusers keeps int64; they are returned as float32 holding those values). Diffusers'
        `set_timesteps` takes no custom sigmas: they are refused."""
        if sigmas is not None:
            raise ValueError("DPMSolverMultistepScheduler takes no custom sigmas")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        n_train = self.config["num_train_timesteps"]
        shift = self.config["flow_shift"]
        if mu is not None:
            if not self.config["use_dynamic_shifting"] or self.config["time_shift_type"] != "exponential":
                raise ValueError(
                    "a mu needs use_dynamic_shifting=True and time_shift_type='exponential' (Diffusers' rule)"
                )
            shift = np.exp(mu)
        base = 1.0 - np.linspace(1, 1 / n_train, num_steps + 1)
        shifted = np.flip(shift * base / (1 + (shift - 1) * base))[:-1].copy()
        timesteps = torch.from_numpy(shifted * n_train).to(torch.int64)
        if num_steps > 1 and timesteps[0] == timesteps[1]:
            # Diffusers finds its first step index by timestep value and would start at the second entry.
            raise ValueError(
                f"{num_steps} steps give a repeated first timestep ({int(timesteps[0])}); use fewer steps"
            )
        full = np.concatenate([shifted, [0]]).astype(np.float32)
        return SigmaSchedule(sigmas=torch.from_numpy(full), timesteps=timesteps.to(torch.float32))

    # --------------------------------------------------------------------------------------- step

    def new_state(self) -> DPMSolverState:
        """Fresh solver history for a request about to take its first step."""
        return DPMSolverState(model_outputs=[None] * self.solver_order)

    @staticmethod
    def _alpha_sigma_lambda(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha, sigma, log-SNR) of a flow-path noise level: `alpha = 1 - sigma`."""
        alpha = 1 - sigma
        return alpha, sigma, torch.log(alpha) - torch.log(sigma)

    def _step_terms(
        self, sigmas: torch.Tensor, i: int, order: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """What the updates from `sigmas[i]` to `sigmas[i + 1]` share: `alpha_t`, `sigma_t / sigma_s0`, the
        log-SNR step `h`, and for the `order - 1` steps before it the ratios `r_k = h_k / h` (h_k the step
        from `sigmas[i - k - 1]` to `sigmas[i - k]`)."""
        alpha_t, sigma_t, lambda_t = self._alpha_sigma_lambda(sigmas[i + 1])
        _, sigma_s0, lambda_s0 = self._alpha_sigma_lambda(sigmas[i])
        h = lambda_t - lambda_s0
        lambdas = [lambda_s0, *(self._alpha_sigma_lambda(sigmas[i - k])[2] for k in range(1, order))]
        ratios = [(later - earlier) / h for later, earlier in pairwise(lambdas)]
        return alpha_t, sigma_t / sigma_s0, h, ratios

    def _first_order(
        self, x0: torch.Tensor, sample: torch.Tensor, sigmas: torch.Tensor, i: int
    ) -> torch.Tensor:
        """DPM-Solver++(1) (DDIM) from `sigmas[i]` to `sigmas[i + 1]`."""
        alpha_t, sigma_ratio, h, _ = self._step_terms(sigmas, i, 1)
        return sigma_ratio * sample - (alpha_t * (torch.exp(-h) - 1.0)) * x0

    def _second_order(
        self, history: list[torch.Tensor], sample: torch.Tensor, sigmas: torch.Tensor, i: int
    ) -> torch.Tensor:
        """Multistep DPM-Solver++(2M) from `sigmas[i]`, using the data predictions at `i` and `i - 1`."""
        alpha_t, sigma_ratio, h, (r0,) = self._step_terms(sigmas, i, 2)
        m0, m1 = history[-1], history[-2]
        d0, d1 = m0, (1.0 / r0) * (m0 - m1)
        if self.config["solver_type"] == "midpoint":
            return (
                sigma_ratio * sample
                - (alpha_t * (torch.exp(-h) - 1.0)) * d0
                - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
            )
        return (
            sigma_ratio * sample
            - (alpha_t * (torch.exp(-h) - 1.0)) * d0
            + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1
        )

    def _third_order(
        self, history: list[torch.Tensor], sample: torch.Tensor, sigmas: torch.Tensor, i: int
    ) -> torch.Tensor:
        """Multistep DPM-Solver++(3M) from `sigmas[i]`, using the data predictions at `i`, `i-1`, `i-2`."""
        alpha_t, sigma_ratio, h, (r0, r1) = self._step_terms(sigmas, i, 3)
        m0, m1, m2 = history[-1], history[-2], history[-3]
        d1_0, d1_1 = (1.0 / r0) * (m0 - m1), (1.0 / r1) * (m1 - m2)
        d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1)
        d2 = (1.0 / (r0 + r1)) * (d1_0 - d1_1)
        return (
            sigma_ratio * sample
            - (alpha_t * (torch.exp(-h) - 1.0)) * m0
            + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1
            - (alpha_t * ((torch.exp(-h) - 1.0 + h) / h**2 - 0.5)) * d2
        )

    def _order_for(self, step_index: int, num_steps: int, state: DPMSolverState) -> int:
        """The update order Diffusers takes at `step_index` of a `num_steps` schedule."""
        short = self.config["lower_order_final"] and num_steps < _SHORT_SCHEDULE
        last = step_index == num_steps - 1
        if self.solver_order == 1 or state.lower_order_nums < 1 or last:
            # At the last step Diffusers always goes first order here: final_sigmas_type is "zero".
            return 1
        if self.solver_order == 2 or state.lower_order_nums < 2 or (step_index == num_steps - 2 and short):
            return 2
        return 3

    def step(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        step_index: int,
        state: DPMSolverState,
        host_sigmas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Advance one request's rows from `sigmas[step_index]` to `sigmas[step_index + 1]`.

        `model_output` is the (guided) velocity prediction at `sample`; all rows share `step_index`.
        `host_sigmas` is the request's schedule on the CPU, where the scalar coefficients are computed
        (as in Diffusers; `sigmas`, its device copy, is not read, and may itself be the CPU copy when
        `host_sigmas` is omitted). `state` comes from `new_state()` and is updated in place; calls for
        one request must use consecutive step indices. Returns the next sample in `model_output`'s dtype.
        """
        if host_sigmas is None:
            host_sigmas = sigmas
        if host_sigmas.device.type != "cpu":
            raise ValueError(
                f"DPM-Solver needs the CPU copy of the sigmas (got {host_sigmas.device}); timestep "
                "preparation sets it once per request"
            )
        num_steps = checked_step_count("DPM-Solver", host_sigmas, step_index, state.last_step_index)
        check_history_length(state.model_outputs, self.solver_order)

        order = self._order_for(step_index, num_steps, state)
        x0 = sample - host_sigmas[step_index] * model_output
        state.model_outputs = [*state.model_outputs[1:], x0]
        sample = sample.to(torch.float32)
        if order == 1:
            prev_sample = self._first_order(x0, sample, host_sigmas, step_index)
        elif order == 2:
            prev_sample = self._second_order(state.model_outputs, sample, host_sigmas, step_index)
        else:
            prev_sample = self._third_order(state.model_outputs, sample, host_sigmas, step_index)
        state.lower_order_nums = min(state.lower_order_nums + 1, self.solver_order)
        state.last_step_index = step_index
        return prev_sample.to(x0.dtype)

    #: The engine's per-request step entry point (`cfg_batch.advance_requests`), the same contract as
    #: FlowMatchEulerScheduler's: here it is `step` itself.
    step_request = step
