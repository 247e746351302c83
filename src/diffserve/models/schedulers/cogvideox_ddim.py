"""CogVideoX's two discrete-time samplers: Diffusers' `CogVideoXDDIMScheduler` (deterministic DDIM) and
`CogVideoXDPMScheduler` (a stochastic DPM-Solver++ (2M) that draws fresh noise at every step).

Both share one training schedule: betas (`linear`, `scaled_linear` in float64, or `squaredcos_cap_v2`), their
cumulative alphas divided by the SNR shift `snr_shift_scale + (1 - snr_shift_scale) * alpha`, optionally
rescaled to zero terminal SNR. A request's schedule is its integer timesteps (`leading`, `linspace` or
`trailing` spacing); each step goes from `t` to `t - num_train_timesteps // num_steps` (whatever the
spacing, as Diffusers does), the last one to `final_alpha_cumprod`. As in `flow_match_euler.py`, the scheduler
holds no request: each request carries its own timesteps, step index and last predicted clean sample
(`SamplerState`).

The scalar coefficients are 0-dim CPU tensors of the cumulative alphas' dtype (float64 for `scaled_linear`,
float32 otherwise; the final alpha of 1 is float32), as Diffusers keeps them, combined in Diffusers' order of
operations and applied to the samples in the same operand positions. torch's rules for a 0-dim CPU tensor
meeting a sample of another dtype (a bfloat16 sample gives a bfloat16 product; how the scalar is rounded
first depends on the operand position and the device) then give Diffusers' results on every device, which
coefficients precomputed as Python floats cannot. No step syncs the host: the coefficients never leave the
CPU, and the steps take the request's timesteps as host integers
(`timesteps(n).tolist()`). `sigmas` of a schedule are a noise level per step for the engine's host-side
reads (step caches): `sqrt(1 - alpha_cumprod[t])`, the last entry the end of the last step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from diffserve.models.config_keys import checked_config_kwargs
from diffserve.models.schedulers.flow_match_euler import SigmaSchedule

_CONFIG_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.0120,
    "beta_schedule": "scaled_linear",
    "trained_betas": None,
    "clip_sample": True,  # read by neither step (Diffusers' do not clip either)
    "set_alpha_to_one": True,
    "steps_offset": 0,
    "prediction_type": "epsilon",
    "clip_sample_range": 1.0,
    "sample_max_value": 1.0,
    "timestep_spacing": "leading",
    "rescale_betas_zero_snr": False,
    "snr_shift_scale": 3.0,
}
_SPACINGS = ("linspace", "leading", "trailing")
_PREDICTIONS = ("epsilon", "sample", "v_prediction")


def _cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    n = num_train_timesteps
    return torch.tensor(
        [min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)], dtype=torch.float32
    )


def _zero_terminal_snr(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Shift and scale sqrt(alpha_cumprod) so the last is 0 and the first unchanged (arXiv 2305.08891)."""
    root = alphas_cumprod.sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * (first / (first - last))
    return root**2


@dataclass
class SamplerState:
    """One request's sampler state: its last predicted clean sample (DPM's history; previews read it for
    both samplers) and the index of its last step."""

    pred_original_sample: torch.Tensor | None = None
    last_step_index: int | None = None


def _check_order(state: SamplerState, step_index: int) -> None:
    if state.last_step_index is not None and step_index != state.last_step_index + 1:
        raise ValueError(
            f"CogVideoX sampler steps must be consecutive: last {state.last_step_index}, got {step_index}"
        )


class _CogVideoXSchedule:
    diffusers_class_name: ClassVar[str]

    def __init__(self, **config: Any) -> None:
        cfg = {**_CONFIG_DEFAULTS, **config}
        if cfg["timestep_spacing"] not in _SPACINGS:
            raise ValueError(f"{self.diffusers_class_name}: timestep_spacing must be one of {_SPACINGS}")
        if cfg["prediction_type"] not in _PREDICTIONS:
            raise ValueError(f"{self.diffusers_class_name}: prediction_type must be one of {_PREDICTIONS}")
        self.config = cfg
        n = int(cfg["num_train_timesteps"])
        if cfg["trained_betas"] is not None:
            betas = torch.tensor(cfg["trained_betas"], dtype=torch.float32)
        elif cfg["beta_schedule"] == "linear":
            betas = torch.linspace(cfg["beta_start"], cfg["beta_end"], n, dtype=torch.float32)
        elif cfg["beta_schedule"] == "scaled_linear":
            betas = (
                torch.linspace(cfg["beta_start"] ** 0.5, cfg["beta_end"] ** 0.5, n, dtype=torch.float64) ** 2
            )
        elif cfg["beta_schedule"] == "squaredcos_cap_v2":
            betas = _cosine_betas(n)
        else:
            raise ValueError(f"{self.diffusers_class_name}: unknown beta_schedule {cfg['beta_schedule']!r}")
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        shift = cfg["snr_shift_scale"]
        alphas_cumprod = alphas_cumprod / (shift + (1 - shift) * alphas_cumprod)
        if cfg["rescale_betas_zero_snr"]:
            alphas_cumprod = _zero_terminal_snr(alphas_cumprod)
        #: Float64 (scaled_linear) or float32, on the CPU, as Diffusers keeps them: the steps' coefficients
        #: are computed from 0-dim entries of these.
        self.alphas_cumprod = alphas_cumprod
        self.final_alpha_cumprod = torch.tensor(1.0) if cfg["set_alpha_to_one"] else alphas_cumprod[0]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _CogVideoXSchedule:
        return cls(**checked_config_kwargs(config, _CONFIG_DEFAULTS, cls.diffusers_class_name))

    def timesteps(self, num_steps: int) -> torch.Tensor:
        """(num_steps,) int64 timesteps, as Diffusers' `set_timesteps`."""
        n_train = int(self.config["num_train_timesteps"])
        if num_steps > n_train:
            raise ValueError(
                f"num_inference_steps {num_steps} cannot exceed the scheduler's num_train_timesteps {n_train}"
            )
        spacing = self.config["timestep_spacing"]
        if spacing == "linspace":
            steps = np.linspace(0, n_train - 1, num_steps).round()[::-1].copy().astype(np.int64)
        elif spacing == "leading":
            ratio = n_train // num_steps
            steps = (np.arange(0, num_steps) * ratio).round()[::-1].copy().astype(np.int64)
            steps += self.config["steps_offset"]
        else:
            ratio = n_train / num_steps
            steps = np.round(np.arange(n_train, 0, -ratio)).astype(np.int64) - 1
        return torch.from_numpy(steps)

    def schedule(self, num_steps: int) -> SigmaSchedule:
        """The request's timesteps (float32 copies of the integers) and a noise level per step (`sigmas`)."""
        steps = self.timesteps(num_steps)
        levels = [math.sqrt(max(0.0, 1.0 - float(self.alphas_cumprod[int(t)]))) for t in steps]
        last = float(self._alpha_prev(int(steps[-1]), num_steps))
        levels.append(math.sqrt(max(0.0, 1.0 - last)))
        return SigmaSchedule(
            sigmas=torch.tensor(levels, dtype=torch.float32), timesteps=steps.to(torch.float32)
        )

    def _alpha(self, t: int) -> torch.Tensor:
        """alpha_cumprod at training timestep `t`: a 0-dim CPU tensor."""
        return self.alphas_cumprod[t]

    def _alpha_prev(self, t: int, num_steps: int) -> torch.Tensor:
        """alpha_cumprod where the step from `t` of a `num_steps` schedule lands (the final alpha past 0)."""
        prev = t - int(self.config["num_train_timesteps"]) // num_steps
        return self.alphas_cumprod[prev] if prev >= 0 else self.final_alpha_cumprod

    def _pred_original(
        self, model_output: torch.Tensor, sample: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """The clean sample the model output predicts at cumulative alpha `alpha` (a 0-dim CPU tensor)."""
        beta = 1 - alpha
        kind = self.config["prediction_type"]
        if kind == "epsilon":
            return (sample - beta**0.5 * model_output) / alpha**0.5
        if kind == "sample":
            return model_output
        return alpha**0.5 * sample - beta**0.5 * model_output


class CogVideoXDDIMScheduler(_CogVideoXSchedule):
    """DDIM (eta 0): x_prev = a_t * x + b_t * x0_pred."""

    diffusers_class_name = "CogVideoXDDIMScheduler"

    def new_state(self) -> SamplerState:
        return SamplerState()

    def step(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        timesteps: Sequence[int],
        step_index: int,
        state: SamplerState,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """One request's step at `timesteps[step_index]` (its timesteps on the host)."""
        _check_order(state, step_index)
        t = int(timesteps[step_index])
        num_steps = len(timesteps)
        alpha, alpha_prev = self._alpha(t), self._alpha_prev(t, num_steps)
        x0 = self._pred_original(model_output, sample, alpha)
        a_t = ((1 - alpha_prev) / (1 - alpha)) ** 0.5
        b_t = alpha_prev**0.5 - alpha**0.5 * a_t
        state.pred_original_sample, state.last_step_index = x0, step_index
        return a_t * sample + b_t * x0


class CogVideoXDPMScheduler(_CogVideoXSchedule):
    """Stochastic DPM-Solver++ (2M): first order at the first step (and a last step to t < 0), second order
    after with the previous clean prediction. Each step draws one noise tensor, two after the first step
    (the first of them unused, as in Diffusers), from the request's generator."""

    diffusers_class_name = "CogVideoXDPMScheduler"

    def new_state(self) -> SamplerState:
        return SamplerState()

    @staticmethod
    def _lambda(alpha: torch.Tensor) -> torch.Tensor:
        """Half the log-SNR of cumulative alpha `alpha` (0-dim, in its dtype): -inf at zero terminal SNR, +inf
        at the final alpha of 1, as in Diffusers."""
        return ((alpha / (1 - alpha)) ** 0.5).log()

    def step(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        timesteps: Sequence[int],
        step_index: int,
        state: SamplerState,
        generator: torch.Generator | None = None,
        noise_shape: tuple[int, ...] | None = None,
        to_sample_layout=None,
    ) -> torch.Tensor:
        """One request's step at `timesteps[step_index]`. The noise is drawn on the generator's device in
        `noise_shape` (Diffusers' latent layout; default the sample's) and put in the sample's layout by
        `to_sample_layout`."""
        _check_order(state, step_index)
        t = int(timesteps[step_index])
        num_steps = len(timesteps)
        prev_t = t - int(self.config["num_train_timesteps"]) // num_steps
        alpha, alpha_prev = self._alpha(t), self._alpha_prev(t, num_steps)
        x0 = self._pred_original(model_output, sample, alpha)
        lamb = self._lambda(alpha)
        h = self._lambda(alpha_prev) - lamb
        mult1 = ((1 - alpha_prev) / (1 - alpha)) ** 0.5 * (-h).exp()
        mult2 = (-2 * h).expm1() * alpha_prev**0.5
        mult_noise = (1 - alpha_prev) ** 0.5 * (1 - (-2 * h).exp()) ** 0.5

        def noise() -> torch.Tensor:
            shape = noise_shape or tuple(sample.shape)
            device = generator.device if generator is not None else sample.device
            drawn = torch.randn(shape, generator=generator, device=device, dtype=sample.dtype)
            drawn = to_sample_layout(drawn) if to_sample_layout is not None else drawn
            return drawn.to(sample.device)

        prev_sample = mult1 * sample - mult2 * x0 + mult_noise * noise()
        old = state.pred_original_sample
        if old is not None and prev_t >= 0:
            # Second order: the step before this one (its log-SNR step over this one's is r).
            r = (lamb - self._lambda(self._alpha(int(timesteps[step_index - 1])))) / h
            mult3, mult4 = 1 + 1 / (2 * r), 1 / (2 * r)
            denoised = mult3 * x0 - mult4 * old
            prev_sample = mult1 * sample - mult2 * denoised + mult_noise * noise()
        state.pred_original_sample, state.last_step_index = x0, step_index
        return prev_sample
