"""UniPC multistep sampler on the flow-matching path (Diffusers' `UniPCMultistepScheduler` as Wan uses it).

UniPC (Zhao et al., 2023) is a predictor-corrector solver for the diffusion ODE written in the
log-SNR variable `lambda = log(alpha) - log(sigma)`; on the flow path `alpha = 1 - sigma`. Each
call to `step` at schedule index `i`:

1. turns the velocity prediction into a data prediction, `x0 = sample - sigma_i * v`;
2. *corrects* the sample that the previous step predicted (UniC), re-using that step's history
   plus the fresh `x0` (skipped at the first step, or where `disable_corrector` says so);
3. *predicts* the sample at `sigma_{i+1}` (UniP) from the last `order` data predictions, where the
   order warms up from 1 and, with `lower_order_final`, drops again over the last steps.

Both updates share their coefficients: `B(h)` is `h` ("bh1") or `expm1(h)` ("bh2"), and the
weights of the history differences solve a small Vandermonde system in the ratios `r_k`.

Diffusers keeps the step index and that history (`model_outputs`, `last_sample`,
`lower_order_nums`, `this_order`) on the scheduler, tying one scheduler to one request. Here the
scheduler holds configuration only: `schedule` computes a request's sigmas, `new_state` makes the
request's history, and `step` advances one request's rows given its sigmas, step index and state,
so the engine can interleave requests that sit at different steps. The scalar maths follows
Diffusers operation for operation (0-d float32 tensors, on the sample's device where Diffusers moves
them there, a CPU scalar where Diffusers keeps one, the same dtype promotions), so results match it
bit for bit. Unlike Diffusers, a step makes no host transfer and no host sync: the request's sigmas
are on the sample's device already (moved once, at timestep preparation), the CPU copy serves the CPU
scalar, and the small linear solves skip the error check that reads their status on the host (the
schedule they come from is checked on the host instead, once per request).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from diffserve.models.config_keys import checked_config_kwargs
from diffserve.models.schedulers.flow_match_euler import SigmaSchedule, shift_sigmas
from diffserve.models.schedulers.multistep_defaults import MULTISTEP_CONFIG_DEFAULTS
from diffserve.models.schedulers.step_order import check_history_length, checked_step_count

#: Diffusers' `UniPCMultistepScheduler` config keys and defaults (a config missing a key means the
#: Diffusers default). Only the flow-matching path is implemented: a config must set
#: use_flow_sigmas=True and prediction_type="flow_prediction", as Wan 2.1's does.
UNIPC_CONFIG_DEFAULTS: dict[str, Any] = {
    **MULTISTEP_CONFIG_DEFAULTS,
    "predict_x0": True,
    "solver_type": "bh2",
    "disable_corrector": [],
    "solver_p": None,
    "sigma_min": None,
    "sigma_max": None,
    "shift_terminal": None,
}

# Diffusers silently maps these legacy solver names onto "bh2".
_BH2_ALIASES = ("midpoint", "heun", "logrho")
# Diffusers nudges a first sigma of exactly 1 below 1 so that log(alpha) stays finite.
_FIRST_SIGMA_EPS = 1e-6


@dataclass
class UniPCState:
    """One request's solver history between `step` calls (what Diffusers keeps on the scheduler).

    `model_outputs` holds the last `solver_order` data predictions, oldest first (`None` until
    filled); `last_sample` is the sample the previous predictor started from, which the next
    corrector re-integrates; `this_order` is the order the previous predictor used.
    """

    model_outputs: list[torch.Tensor | None]
    last_sample: torch.Tensor | None = None
    lower_order_nums: int = 0
    this_order: int = 0
    # Replaces Diffusers' `timestep_list` (read only by its unsupported `solver_p`): lets `step`
    # refuse out-of-order calls, which would silently pair the history with the wrong sigmas.
    last_step_index: int | None = None


def solve_without_host_check(rows: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """`torch.linalg.solve(rows, rhs)`, bit for bit (it is `solve_ex` plus a check), without the check
    of the factorisation's status, which reads it on the host: a device sync per step on accelerators.
    The systems are Vandermonde matrices in the log-SNR ratios of the steps' source sigmas, singular
    only when two of those sigmas are equal, which `schedule` refuses on the host."""
    solution, _info = torch.linalg.solve_ex(rows, rhs, check_errors=False)
    return solution


class UniPCFlowScheduler:
    """UniPC (predictor-corrector) sampler for flow-matching models. Stateless across requests."""

    diffusers_class_name: ClassVar[str] = "UniPCMultistepScheduler"

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_start: float = 0.0001,
        beta_end: float = 0.02,
        beta_schedule: str = "linear",
        trained_betas: list[float] | None = None,
        solver_order: int = 2,
        prediction_type: str = "flow_prediction",
        thresholding: bool = False,
        dynamic_thresholding_ratio: float = 0.995,
        sample_max_value: float = 1.0,
        predict_x0: bool = True,
        solver_type: str = "bh2",
        lower_order_final: bool = True,
        disable_corrector: list[int] | tuple[int, ...] = (),
        solver_p: Any = None,
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        use_flow_sigmas: bool = True,
        flow_shift: float = 1.0,
        timestep_spacing: str = "linspace",
        steps_offset: int = 0,
        final_sigmas_type: str = "zero",
        rescale_betas_zero_snr: bool = False,
        use_dynamic_shifting: bool = False,
        time_shift_type: str = "exponential",
        sigma_min: float | None = None,
        sigma_max: float | None = None,
        shift_terminal: float | None = None,
    ) -> None:
        # The beta-schedule keys, steps_offset, timestep_spacing, sigma_min/max and the thresholding
        # parameters only feed Diffusers' non-flow paths; they are accepted and recorded, not used.
        if not use_flow_sigmas:
            raise ValueError("UniPCFlowScheduler implements only the flow path: use_flow_sigmas must be True")
        if prediction_type != "flow_prediction":
            raise ValueError(f"prediction_type must be 'flow_prediction', got {prediction_type!r}")
        if not predict_x0:
            raise ValueError("predict_x0=False (noise-prediction UniPC) is not supported")
        if solver_type in _BH2_ALIASES:
            solver_type = "bh2"
        if solver_type not in ("bh1", "bh2"):
            raise ValueError(f"solver_type must be 'bh1' or 'bh2', got {solver_type!r}")
        if thresholding:
            raise ValueError("thresholding=True is not supported")
        for key, value in (
            ("use_karras_sigmas", use_karras_sigmas),
            ("use_exponential_sigmas", use_exponential_sigmas),
            ("use_beta_sigmas", use_beta_sigmas),
        ):
            if value:
                raise ValueError(f"scheduler option {key}=True is not supported by diffserve yet")
        if solver_p is not None:
            raise ValueError("solver_p (an external predictor scheduler) is not supported")
        if final_sigmas_type not in ("zero", "sigma_min"):
            raise ValueError(f"final_sigmas_type must be 'zero' or 'sigma_min', got {final_sigmas_type!r}")
        if timestep_spacing not in ("linspace", "leading", "trailing"):
            raise ValueError(
                f"timestep_spacing must be 'linspace', 'leading' or 'trailing', got {timestep_spacing!r}"
            )
        if time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"time_shift_type must be 'exponential' or 'linear', got {time_shift_type!r}")
        if beta_schedule not in ("linear", "scaled_linear", "squaredcos_cap_v2"):
            raise ValueError(f"unknown beta_schedule {beta_schedule!r}")
        if int(solver_order) < 1:
            raise ValueError(f"solver_order must be >= 1, got {solver_order}")
        # Without lower_order_final the last step is a multistep update across a degenerate log-SNR
        # step (h = inf towards a final sigma of 0, h = 0 towards a repeated sigma_min), and Diffusers
        # returns non-finite samples: NaN for "bh1" towards 0 (B(h) = -inf times a zero residual), inf
        # for order >= 2 towards 0, NaN for order >= 3 towards sigma_min. Refuse those configurations
        # rather than serve them.
        if final_sigmas_type == "zero" and solver_type == "bh1":
            raise ValueError("solver_type='bh1' with final_sigmas_type='zero' gives NaN samples in Diffusers")
        if not lower_order_final and solver_order > (1 if final_sigmas_type == "zero" else 2):
            raise ValueError(
                f"lower_order_final=False with final_sigmas_type={final_sigmas_type!r} and "
                f"solver_order={solver_order} gives non-finite samples in Diffusers"
            )
        self.config: dict[str, Any] = {
            "num_train_timesteps": num_train_timesteps,
            "beta_start": beta_start,
            "beta_end": beta_end,
            "beta_schedule": beta_schedule,
            "trained_betas": trained_betas,
            "solver_order": int(solver_order),
            "prediction_type": prediction_type,
            "thresholding": thresholding,
            "dynamic_thresholding_ratio": dynamic_thresholding_ratio,
            "sample_max_value": sample_max_value,
            "predict_x0": predict_x0,
            "solver_type": solver_type,
            "lower_order_final": lower_order_final,
            "disable_corrector": list(disable_corrector),
            "solver_p": solver_p,
            "use_karras_sigmas": use_karras_sigmas,
            "use_exponential_sigmas": use_exponential_sigmas,
            "use_beta_sigmas": use_beta_sigmas,
            "use_flow_sigmas": use_flow_sigmas,
            "flow_shift": flow_shift,
            "timestep_spacing": timestep_spacing,
            "steps_offset": steps_offset,
            "final_sigmas_type": final_sigmas_type,
            "rescale_betas_zero_snr": rescale_betas_zero_snr,
            "use_dynamic_shifting": use_dynamic_shifting,
            "time_shift_type": time_shift_type,
            "sigma_min": sigma_min,
            "sigma_max": sigma_max,
            "shift_terminal": shift_terminal,
        }
        self.solver_order = int(solver_order)
        self._disabled_correctors = frozenset(int(i) for i in disable_corrector)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> UniPCFlowScheduler:
        """Build from a Diffusers `scheduler_config.json` dict; missing keys take Diffusers' defaults."""
        kwargs = checked_config_kwargs(config, UNIPC_CONFIG_DEFAULTS, cls.diffusers_class_name)
        return cls(**{**UNIPC_CONFIG_DEFAULTS, **kwargs})

    # ----------------------------------------------------------------------------------- schedule

    def schedule(
        self, num_steps: int, mu: float | None = None, sigmas: np.ndarray | list[float] | None = None
    ) -> SigmaSchedule:
        """The sigmas (with the final entry appended) and model timesteps for `num_steps` steps.

        Timesteps are `sigma * num_train_timesteps` truncated to integers, as Diffusers stores them
        (int64); they are returned as float32 holding those integer values. Pass `mu` when
        `use_dynamic_shifting` is on; `sigmas` overrides the default linear ramp before shifting.
        """
        if self.config["use_dynamic_shifting"] and mu is None:
            raise ValueError("this scheduler uses dynamic shifting: pass mu")
        n_train = self.config["num_train_timesteps"]
        if sigmas is None:
            if num_steps < 1:
                raise ValueError(f"num_steps must be >= 1, got {num_steps}")
            base = np.linspace(1, 1 / n_train, num_steps + 1)[:-1]
        else:
            # The caller's dtype is kept (a float32 array stays float32 through the shift, as in Diffusers).
            base = np.array(sigmas)
            if len(base) != num_steps:
                raise ValueError(f"got {len(base)} sigmas for {num_steps} steps")
        dynamic_mu = mu if self.config["use_dynamic_shifting"] else None
        shifted = shift_sigmas(base, self.config["flow_shift"], dynamic_mu, self.config["time_shift_type"])
        if self.config["shift_terminal"] and 1 - shifted[-1] != 0:
            # Stretch so the last sigma lands on shift_terminal. A schedule ending at sigma 1 (one step from
            # the default ramp) would divide 0 by 0, where Diffusers returns NaN samples; it is left
            # unstretched instead, as FlowMatchEulerScheduler.schedule does.
            one_minus = 1 - shifted
            shifted = 1 - one_minus / (one_minus[-1] / (1 - self.config["shift_terminal"]))
        shifted = np.array(shifted)
        if np.fabs(shifted[0] - 1) < _FIRST_SIGMA_EPS:
            shifted[0] -= _FIRST_SIGMA_EPS
        timesteps = torch.from_numpy(shifted * n_train).to(torch.int64).to(torch.float32)
        last = shifted[-1] if self.config["final_sigmas_type"] == "sigma_min" else 0
        full = np.concatenate([shifted, [last]]).astype(np.float32)
        if self.solver_order > 1 and not np.all(np.diff(full[:-1]) < 0):
            # The multistep updates solve Vandermonde systems in these sigmas' log-SNRs without checking
            # the solve on the device (`solve_without_host_check`): a repeated sigma would make them singular.
            raise ValueError(
                f"UniPC needs strictly decreasing sigmas over the steps, got {full[:-1].tolist()}"
            )
        return SigmaSchedule(sigmas=torch.from_numpy(full), timesteps=timesteps)

    # --------------------------------------------------------------------------------------- step

    def new_state(self) -> UniPCState:
        """Fresh solver history for a request about to take its first step (at any step index)."""
        return UniPCState(model_outputs=[None] * self.solver_order)

    @staticmethod
    def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
        """`lambda = log(alpha) - log(sigma)` with the flow path's `alpha = 1 - sigma`."""
        return torch.log(1 - sigma) - torch.log(sigma)

    def _bh_coefficients(
        self,
        sigmas: torch.Tensor,
        target: int,
        order: int,
        history: list[torch.Tensor],
        device: torch.device,
    ) -> tuple[torch.Tensor, ...]:
        """The quantities UniP and UniC share for an update from `sigmas[target - 1]` to `sigmas[target]`.

        `sigmas` is on `device` (Diffusers moves each entry there as it reads it). `history` is the data
        predictions, newest first; its head `m0` belongs to the source sigma and entry k to
        `sigmas[target - 1 - k]`. Returns `(alpha_t, sigma_t, sigma_s0, h_phi_1, B_h, R, b, D1s)` with
        `D1s` the stacked scaled differences `(m_k - m0) / r_k`, or None at order 1.
        """
        sigma_t = sigmas[target]
        sigma_s0 = sigmas[target - 1]
        alpha_t = 1 - sigma_t
        lambda_t = self._log_snr(sigma_t)
        lambda_s0 = self._log_snr(sigma_s0)
        h = lambda_t - lambda_s0
        m0 = history[0]

        ratios = []
        diffs = []
        for k in range(1, order):
            lambda_sk = self._log_snr(sigmas[target - 1 - k])
            r_k = (lambda_sk - lambda_s0) / h
            ratios.append(r_k)
            diffs.append((history[k] - m0) / r_k)
        ratios.append(torch.ones((), device=device))
        rks = torch.stack(ratios)

        # Data prediction integrates over -h; phi_k(-h) follows the recursion phi_{k+1} = (phi_k - 1/k!) / (-h).
        hh = -h
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        b_h = hh if self.config["solver_type"] == "bh1" else torch.expm1(hh)
        rows = []
        rhs = []
        factorial = 1
        for i in range(1, order + 1):
            rows.append(torch.pow(rks, i - 1))
            rhs.append(h_phi_k * factorial / b_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        d1s = torch.stack(diffs, dim=1) if diffs else None
        return alpha_t, sigma_t, sigma_s0, h_phi_1, b_h, torch.stack(rows), torch.stack(rhs), d1s

    def _predict(
        self, sample: torch.Tensor, sigmas: torch.Tensor, step_index: int, order: int, state: UniPCState
    ) -> torch.Tensor:
        """UniP: extrapolate from `sigmas[step_index]` to `sigmas[step_index + 1]`."""
        history = [m for m in reversed(state.model_outputs) if m is not None]
        alpha_t, sigma_t, sigma_s0, h_phi_1, b_h, rows, rhs, d1s = self._bh_coefficients(
            sigmas, step_index + 1, order, history, sample.device
        )
        residual: torch.Tensor | int = 0
        if d1s is not None:
            if order == 2:
                # The 1x1 system has the closed-form solution 1/2 that Diffusers uses directly.
                rhos = torch.ones(1, dtype=sample.dtype, device=sample.device) * 0.5
            else:
                rhos = solve_without_host_check(rows[:-1, :-1], rhs[:-1]).to(sample.dtype)
            residual = torch.einsum("k,bkc...->bc...", rhos, d1s)
        x_t = sigma_t / sigma_s0 * sample - alpha_t * h_phi_1 * history[0]
        x_t = x_t - alpha_t * b_h * residual
        return x_t.to(sample.dtype)

    def _correct(
        self,
        x0_now: torch.Tensor,
        last_sample: torch.Tensor,
        predicted: torch.Tensor,
        sigmas: torch.Tensor,
        step_index: int,
        order: int,
        state: UniPCState,
    ) -> torch.Tensor:
        """UniC: redo the previous step from `last_sample`, now also using the data prediction at its end."""
        history = [m for m in reversed(state.model_outputs) if m is not None]
        alpha_t, sigma_t, sigma_s0, h_phi_1, b_h, rows, rhs, d1s = self._bh_coefficients(
            sigmas, step_index, order, history, predicted.device
        )
        if order == 1:
            rhos = torch.ones(1, dtype=last_sample.dtype, device=predicted.device) * 0.5
        else:
            rhos = solve_without_host_check(rows, rhs).to(last_sample.dtype)
        residual: torch.Tensor | int = 0
        if d1s is not None:
            residual = torch.einsum("k,bkc...->bc...", rhos[:-1], d1s)
        m0 = history[0]
        x_t = sigma_t / sigma_s0 * last_sample - alpha_t * h_phi_1 * m0
        x_t = x_t - alpha_t * b_h * (residual + rhos[-1] * (x0_now - m0))
        return x_t.to(last_sample.dtype)

    def step(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        step_index: int,
        state: UniPCState,
        host_sigmas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Advance one request's rows from `sigmas[step_index]` to `sigmas[step_index + 1]`.

        `model_output` is the (guided) velocity prediction at `sample`, shape (batch, channels, ...);
        all rows share `step_index`. `sigmas` is the request's `schedule(...).sigmas` on the sample's
        device and `host_sigmas` the same on the CPU (it may be omitted when `sigmas` is on the CPU).
        `state` comes from `new_state()` and is updated in place; calls for one request must use
        consecutive step indices. Returns the next sample in `sample`'s dtype.
        """
        if host_sigmas is None:
            host_sigmas = sigmas
        if sigmas.device != sample.device or host_sigmas.device.type != "cpu":
            raise ValueError(
                f"UniPC needs the sigmas on the sample's device ({sample.device}, got {sigmas.device}) and "
                f"their CPU copy (got {host_sigmas.device}); timestep preparation sets both once per request"
            )
        num_steps = checked_step_count("UniPC", sigmas, step_index, state.last_step_index)
        check_history_length(state.model_outputs, self.solver_order)

        # Velocity -> data prediction (sigma stays a 0-d CPU tensor here, as in Diffusers).
        x0 = sample - host_sigmas[step_index] * model_output

        use_corrector = (
            step_index > 0
            and (step_index - 1) not in self._disabled_correctors
            and state.last_sample is not None
        )
        if use_corrector:
            sample = self._correct(x0, state.last_sample, sample, sigmas, step_index, state.this_order, state)

        state.model_outputs = [*state.model_outputs[1:], x0]
        order = self.solver_order
        if self.config["lower_order_final"]:
            order = min(order, num_steps - step_index)
        state.this_order = min(order, state.lower_order_nums + 1)
        state.last_sample = sample

        prev_sample = self._predict(sample, sigmas, step_index, state.this_order, state)

        state.lower_order_nums = min(state.lower_order_nums + 1, self.solver_order)
        state.last_step_index = step_index
        return prev_sample

    #: The engine's per-request step entry point (`cfg_batch.advance_requests`), the same contract as
    #: FlowMatchEulerScheduler's: here it is `step` itself.
    step_request = step
