"""Qwen-Image 2.1's own stages, as Diffusers' `QwenImage21Pipeline` does each job.

- Validation: sizes default to 1024 (the request's `output_resolution` in `extra`, Diffusers' argument)
  and must be multiples of 32; the VAE's RGBA output is written as png;
  a folder's `sample_sigmas` fix the step count (their length): another count asked for is replaced
  (logged), as Diffusers ignores it.
- Latents: noise (outputs, 1, channels, h, w) drawn on the request's CPU generator in the model's dtype,
  flattened to (outputs, h * w, channels) tokens (the DiT is unpatched).
- Timesteps: the folder's `sample_sigmas`, else linspace(1, 1/n, n), through the scheduler with the
  resolution shift `mu` of the h * w latent tokens.
- Decoding: tokens back to (outputs, channels, 1, h, w), `latents * std + mean`, the VAE's decode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.qwen_image21.config import qwen_image21_settings
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.request import LatentSize, Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout, tensor_to_pil
from diffserve.stages.input_validation import InputValidationStage
from diffserve.stages.timestep_preparation import set_schedule

PIPELINE_NAME = "QwenImage21Pipeline"
logger = logging.getLogger("diffserve.families")


class QwenImage21InputValidationStage(InputValidationStage):
    """The shared validation, plus the family's settings in `extra` (`QwenImage21Settings`), the folder's
    fixed step count and png for RGBA output."""

    takes_family_settings = True

    def __init__(self, *, sample_sigmas: Sequence[float] | None, rgba: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sample_sigmas = sample_sigmas
        self.rgba = rgba

    def resolve(self, params: SamplingParams) -> SamplingParams:
        qwen_image21_settings(params)  # a bad setting is named before the size default reads it
        resolved = super().resolve(params)
        fixed = self.sample_sigmas
        if fixed is not None and resolved.num_inference_steps != len(fixed):
            # Diffusers ignores num_inference_steps where the folder fixes the schedule: the same image,
            # with the change said in the log rather than dropped silently.
            logger.warning(
                "%s: this folder fixes its schedule (model_index.json's sample_sigmas): %d steps, not the "
                "%d asked for (as Diffusers runs it)",
                PIPELINE_NAME, len(fixed), resolved.num_inference_steps,
            )  # fmt: skip
            resolved = replace(resolved, num_inference_steps=len(fixed))
        if self.rgba and resolved.output_format != "png":
            raise InvalidRequestError(
                f"{PIPELINE_NAME}'s VAE outputs RGBA images: output_format must be png "
                f"({resolved.output_format} would drop their transparency)",
                param="output_format",
            )
        return resolved


class QwenImage21LatentPreparationStage(Stage):
    needs = ("generator", "prompt_embeds")
    sets = ("latents", "latent_size")

    def __init__(self, channels: int, scale: int, device: torch.device, dtype: torch.dtype) -> None:
        self.channels, self.scale = channels, scale
        self.device, self.dtype = device, dtype

    def forward(self, req: Req) -> Req:
        p = req.params
        h, w = p.height // self.scale, p.width // self.scale
        shape = (p.num_outputs_per_prompt, 1, self.channels, h, w)
        noise = torch.randn(shape, generator=req.generator, device="cpu", dtype=self.dtype)
        req.latents = noise.view(shape[0], self.channels, h * w).transpose(1, 2).to(self.device)
        req.latent_size = LatentSize(h, w)
        return req


class QwenImage21TimestepPreparationStage(Stage):
    needs = ("latents",)
    sets = ("schedule",)

    def __init__(self, scheduler: FlowMatchEulerScheduler, sample_sigmas: Sequence[float] | None) -> None:
        self.scheduler = scheduler
        self.sample_sigmas = sample_sigmas

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        sigmas = self.sample_sigmas if self.sample_sigmas is not None else np.linspace(1.0, 1 / steps, steps)
        mu = self.scheduler.resolution_shift_mu(int(req.latents.shape[1]))
        set_schedule(req, self.scheduler.schedule(steps, mu=mu, sigmas=sigmas))
        return req


class QwenImage21DecodingStage(Stage):
    """(outputs, h * w, channels) tokens -> PIL images (RGBA for the released four-channel VAE)."""

    needs = ("latents", "latent_size")
    sets = ("outputs.images",)

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae

    def decode_layout(self) -> DecodeLayout:
        raise NotImplementedError("Qwen-Image 2.1 has no step previews yet (unpatched, per-channel latents)")

    def unnormalise(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        view = (1, int(config["z_dim"]), 1, 1, 1)
        mean = torch.tensor(config["latents_mean"]).view(view).to(latents.device, latents.dtype)
        std = torch.tensor(config["latents_std"]).view(view).to(latents.device, latents.dtype)
        return latents * std + mean

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        h, w = req.latent_size
        tokens = req.latents
        latents = tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], 1, h, w)
        latents = self.unnormalise(to_module(self.vae, latents))
        req.outputs.images = tensor_to_pil(self.vae.decode(latents)[:, :, 0])
        return req
