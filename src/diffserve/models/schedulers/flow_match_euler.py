"""Flow-matching Euler sampler (Diffusers' `FlowMatchEulerDiscreteScheduler`), without per-request state.

Diffusers' scheduler keeps the current step index on the scheduler object, which ties one
scheduler to one request. Here the scheduler only *computes* a request's sigma schedule
(`schedule`) and performs one Euler update for a batch whose samples may sit at different
steps (`step`); each request carries its own sigmas and step index. Numerics follow Diffusers:
sigmas are computed in float32 numpy, the update is taken in the model output's dtype and added to the
float32 sample, and the result is cast back to the output's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from diffserve.models.config_keys import checked_config_kwargs

_SUPPORTED_KEYS = {
    "num_train_timesteps",
    "shift",
    "use_dynamic_shifting",
    "base_shift",
    "max_shift",
    "base_image_seq_len",
    "max_image_seq_len",
    "invert_sigmas",
    "shift_terminal",
    "time_shift_type",
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "stochastic_sampling",
}
#: Refused when set: beta sigmas need scipy's beta distribution (diffusers imports scipy for them), and
#: stochastic sampling draws fresh noise inside each step, which this stateless Euler step does not take.
_UNSUPPORTED_WHEN_TRUE = ("use_beta_sigmas", "stochastic_sampling")
#: Diffusers' sigma-spacing options, of which a config may set one.
_SPACING_OPTIONS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
#: Karras et al.'s rho (the value diffusers' conversion uses).
KARRAS_RHO = 7.0


@dataclass(frozen=True)
class SigmaSchedule:
    """One request's schedule: `sigmas` has one more entry than `timesteps` (the final 0). Computed on
    the CPU; timestep preparation puts it on the latents' device once per request."""

    sigmas: torch.Tensor  # (num_steps + 1,) float32, on CPU
    timesteps: torch.Tensor  # (num_steps,) float32, on CPU

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


def shift_sigmas(sigmas: np.ndarray, shift: float, mu: float | None, time_shift_type: str) -> np.ndarray:
    """Diffusers' flow-matching sigma shift: the static `shift * s / (1 + (shift - 1) * s)` when `mu` is
    None, else the dynamic time shift by `mu` (`time_shift_type` "exponential" or "linear")."""
    if mu is None:
        return shift * sigmas / (1 + (shift - 1) * sigmas)
    if time_shift_type == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
    return mu / (mu + (1 / sigmas - 1) ** 1.0)


def respace_sigmas(sigmas: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Diffusers' optional re-spacing of a shifted schedule between its first and last sigma, as the
    config asks: Karras et al.'s (`use_karras_sigmas`: uniform in sigma ** (1 / rho)) or log-uniform
    (`use_exponential_sigmas`); else `sigmas` unchanged. The same number of sigmas."""
    if not (config["use_karras_sigmas"] or config["use_exponential_sigmas"]):
        return sigmas
    sigma_max, sigma_min = sigmas[0].item(), sigmas[-1].item()
    if config["use_karras_sigmas"]:
        ramp = np.linspace(0, 1, len(sigmas))
        max_inv_rho, min_inv_rho = sigma_max ** (1 / KARRAS_RHO), sigma_min ** (1 / KARRAS_RHO)
        return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** KARRAS_RHO
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), len(sigmas)))


class FlowMatchEulerScheduler:
    """Computes flow-matching sigma schedules and Euler steps. Stateless across requests."""

    diffusers_class_name = "FlowMatchEulerDiscreteScheduler"

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        shift: float = 1.0,
        use_dynamic_shifting: bool = False,
        base_shift: float | None = 0.5,
        max_shift: float | None = 1.15,
        base_image_seq_len: int = 256,
        max_image_seq_len: int = 4096,
        invert_sigmas: bool = False,
        shift_terminal: float | None = None,
        time_shift_type: str = "exponential",
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        stochastic_sampling: bool = False,
    ) -> None:
        if time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"time_shift_type must be 'exponential' or 'linear', got {time_shift_type!r}")
        self.config: dict[str, Any] = {
            "num_train_timesteps": num_train_timesteps,
            "shift": shift,
            "use_dynamic_shifting": use_dynamic_shifting,
            "base_shift": base_shift,
            "max_shift": max_shift,
            "base_image_seq_len": base_image_seq_len,
            "max_image_seq_len": max_image_seq_len,
            "invert_sigmas": invert_sigmas,
            "shift_terminal": shift_terminal,
            "time_shift_type": time_shift_type,
            "use_karras_sigmas": use_karras_sigmas,
            "use_exponential_sigmas": use_exponential_sigmas,
            "use_beta_sigmas": use_beta_sigmas,
            "stochastic_sampling": stochastic_sampling,
        }
        if sum(bool(self.config[key]) for key in _SPACING_OPTIONS) > 1:
            raise ValueError(f"only one of {', '.join(_SPACING_OPTIONS)} can be True")
        for key in _UNSUPPORTED_WHEN_TRUE:
            if self.config[key]:
                raise ValueError(f"scheduler option {key}=True is not supported by diffserve yet")
        # The training schedule's extremes bound the default inference schedule (as in Diffusers).
        train_sigmas = np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1]
        train_sigmas = train_sigmas / num_train_timesteps
        if not use_dynamic_shifting:
            train_sigmas = shift * train_sigmas / (1 + (shift - 1) * train_sigmas)
        self.sigma_max = float(train_sigmas[0])
        self.sigma_min = float(train_sigmas[-1])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FlowMatchEulerScheduler:
        return cls(**checked_config_kwargs(config, _SUPPORTED_KEYS, cls.diffusers_class_name))

    def resolution_shift_mu(self, image_seq_len: int) -> float:
        """FLUX's resolution-dependent shift: `mu` grows linearly with the image token count."""
        base_len = self.config["base_image_seq_len"]
        max_len = self.config["max_image_seq_len"]
        base_shift = self.config["base_shift"]
        max_shift = self.config["max_shift"]
        slope = (max_shift - base_shift) / (max_len - base_len)
        return image_seq_len * slope + (base_shift - slope * base_len)

    def schedule(
        self, num_steps: int, mu: float | None = None, sigmas: np.ndarray | list[float] | None = None
    ) -> SigmaSchedule:
        """The sigma/timestep schedule for `num_steps` steps (pass `mu` when dynamic shifting is on)."""
        if self.config["use_dynamic_shifting"] and mu is None:
            raise ValueError("this scheduler uses dynamic shifting: pass mu (see resolution_shift_mu)")
        if sigmas is None:
            n_train = self.config["num_train_timesteps"]
            timesteps = np.linspace(self.sigma_max * n_train, self.sigma_min * n_train, num_steps)
            base = timesteps / n_train
        else:
            base = np.array(sigmas).astype(np.float32)
            if len(base) != num_steps:
                raise ValueError(f"got {len(base)} sigmas for {num_steps} steps")
        dynamic_mu = mu if self.config["use_dynamic_shifting"] else None
        shifted = shift_sigmas(base, self.config["shift"], dynamic_mu, self.config["time_shift_type"])
        if self.config["shift_terminal"] and 1 - shifted[-1] != 0:
            # Stretch so the last sigma lands on shift_terminal. A one-step schedule ends at sigma 1,
            # where Diffusers divides 0 by 0 and returns NaN; it is left unstretched instead.
            one_minus = 1 - shifted
            shifted = 1 - one_minus / (one_minus[-1] / (1 - self.config["shift_terminal"]))
        shifted = respace_sigmas(np.asarray(shifted), self.config)
        sig = torch.from_numpy(np.asarray(shifted)).to(dtype=torch.float32)
        if self.config["invert_sigmas"]:
            sig = 1.0 - sig
            return SigmaSchedule(
                sigmas=torch.cat([sig, torch.ones(1)]), timesteps=sig * self.config["num_train_timesteps"]
            )
        return SigmaSchedule(
            sigmas=torch.cat([sig, torch.zeros(1)]), timesteps=sig * self.config["num_train_timesteps"]
        )

    def new_state(self) -> None:
        """Euler needs no per-request history (multistep schedulers return theirs here)."""
        return None

    def step_request(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        step_index: int,
        state: None,
        host_sigmas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One request's step (all its rows at `step_index` of its own `sigmas`, on the sample's device).
        `host_sigmas` (the CPU copy) is part of the engine's step contract; Euler does not need it."""
        n = sample.shape[0]
        return self.step(model_output, sample, sigmas[step_index].expand(n), sigmas[step_index + 1].expand(n))

    @staticmethod
    def step(
        model_output: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
    ) -> torch.Tensor:
        """One Euler step for a batch: `sigma`/`sigma_next` are per-sample (batch,) float32 tensors on the
        sample's device (a step never copies them there: that would be a host sync per step).

        As in Diffusers, the update `dt * model_output` is taken in the model output's dtype before it is
        added to the float32 sample: Diffusers' `dt` is a 0-dim float32 tensor on the sample's device, so
        with a bfloat16/float16 output torch rounds `dt` to that dtype and the product stays in it."""
        shape = (-1,) + (1,) * (sample.dim() - 1)
        dt = (sigma_next - sigma).to(torch.float32).view(shape).to(model_output.dtype)
        return (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)
