"""Mochi's own stages, as Diffusers' `MochiPipeline` does each job.

- Text: T5's last hidden states of the prompt padded (and truncated) to `max_sequence_length` tokens, run
  with its attention mask; the mask travels with the states (the DiT leaves the padding out). With the
  folder's `force_zeros_for_empty_prompt`, an empty prompt is all-zero ids under an all-zero mask.
- Latents: noise (batch, channels, frames, h, w) drawn in float32 on the request's CPU generator, then cast
  to the model's dtype.
- Timesteps: Diffusers' linear-quadratic sigmas (linear to `threshold_noise` over the first half of the
  steps, quadratic to 1 over the rest, then 1 - sigma), through the folder's flow-matching scheduler (the
  released one inverts them: timesteps rise from 0 to ~1000).
- Decoding: the latents un-normalised with the VAE's `latents_mean` / `latents_std` (x * std /
  scaling_factor + mean; without them x / scaling_factor), then the VAE's decode.
"""

from __future__ import annotations

import torch
from torch import nn

from diffserve.distributed.parallel_vae import decode_split
from diffserve.errors import InvalidRequestError
from diffserve.families.mochi.conditioning import MochiConditioning
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout
from diffserve.stages.input_validation import InputValidationStage
from diffserve.stages.latent_preparation import VideoLatentPreparationStage, initial_noise
from diffserve.stages.text_encoding import CachedTextEncodingStage, request_prompts
from diffserve.stages.timestep_preparation import set_schedule
from diffserve.stages.video_vae_decoding import video_to_uint8


def linear_quadratic_sigmas(num_steps: int, threshold_noise: float) -> list[float]:
    """Mochi's schedule: 1 - s for s rising linearly from 0 by threshold_noise / (n // 2) over the first
    n // 2 steps, then along the quadratic that continues it to reach 1 after the last step."""
    linear = num_steps // 2
    quadratic = num_steps - linear
    gap = linear - threshold_noise * num_steps
    a = gap / (linear * quadratic**2)
    b = threshold_noise / linear - 2 * gap / (quadratic**2)
    c = a * (linear**2)
    rising = [i * threshold_noise / linear for i in range(linear)]
    rising += [a * (i**2) + b * i + c for i in range(linear, num_steps)]
    return [1.0 - s for s in rising]


#: The fewest steps Mochi's schedule takes: its linear half (n // 2 steps) needs one.
MIN_STEPS = 2


class MochiInputValidationStage(InputValidationStage):
    """The shared validation, plus at least `MIN_STEPS` steps, which its probe requests run too."""

    def probe_steps(self) -> int:
        """`MIN_STEPS`: a one-step probe (warm-up, calibration, /health_generate) would be refused."""
        return MIN_STEPS

    def resolve(self, params):
        resolved = super().resolve(params)
        if resolved.num_inference_steps < MIN_STEPS:
            raise InvalidRequestError(
                f"num_inference_steps must be at least {MIN_STEPS} for Mochi (its linear-quadratic schedule), "
                f"got {resolved.num_inference_steps}",
                param="num_inference_steps",
            )
        return resolved


class MochiTextEncodingStage(CachedTextEncodingStage):
    sets = ("prompt_embeds", "conditioning.text_mask")

    def __init__(self, tokenizer, text_encoder: nn.Module, output_dtype: torch.dtype, zeros_for_empty: bool):
        super().__init__(tokenizer, text_encoder, output_dtype)
        self.zeros_for_empty = zeros_for_empty

    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(prompts), L, dim) T5 states and their (len(prompts), L) bool mask."""
        device = next(self.text_encoder.parameters()).device
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids, tokens.attention_mask.bool()
        if self.zeros_for_empty:
            empty = torch.tensor([p == "" for p in prompts])[:, None]
            ids = ids.masked_fill(empty, 0)
            mask = mask & ~empty
        ids, mask = ids.to(device), mask.to(device)
        return self.text_encoder(ids, attention_mask=mask)[0].to(self.output_dtype), mask

    def forward(self, req: Req) -> Req:
        msl = req.params.max_sequence_length

        def rows(batch: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            states, mask = self.encode(batch, msl)
            return [(states[i : i + 1].clone(), mask[i : i + 1].clone()) for i in range(len(batch))]

        values = self.cache.lookup(request_prompts(req), (msl,), rows)
        n = req.params.num_outputs_per_prompt
        conditioning = MochiConditioning.of(req)
        req.prompt_embeds = values[0][0].repeat(n, 1, 1)
        conditioning.text_mask = values[0][1].repeat(n, 1)
        if req.do_cfg:
            req.negative_prompt_embeds = values[1][0].repeat(n, 1, 1)
            conditioning.negative_text_mask = values[1][1].repeat(n, 1)
        return req


class MochiLatentPreparationStage(VideoLatentPreparationStage):
    """The shared video noise, drawn in float32 and rounded to `dtype` (the DiT's) before it moves to the
    device, as Diffusers' Mochi draws it."""

    def noise(self, req: Req, shape: tuple[int, ...]) -> torch.Tensor:
        return initial_noise(req, shape, torch.float32).to(self.dtype).to(self.device)


class MochiTimestepPreparationStage(Stage):
    needs = ("latents",)
    sets = ("schedule",)

    def __init__(self, scheduler, threshold_noise: float) -> None:
        self.scheduler = scheduler
        self.threshold_noise = threshold_noise

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        sigmas = linear_quadratic_sigmas(steps, self.threshold_noise)
        set_schedule(req, self.scheduler.schedule(steps, sigmas=sigmas))
        return req


class MochiDecodingStage(Stage):
    """(batch, channels, frames, h, w) latents -> one uint8 (frames, H, W, 3) array per output video."""

    needs = ("latents",)
    sets = ("outputs.frames",)

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae

    def decode_layout(self) -> DecodeLayout:
        raise NotImplementedError("Mochi has no step previews yet (its latents are normalised per channel)")

    def unnormalise(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        mean, std = config.get("latents_mean"), config.get("latents_std")
        factor = float(config["scaling_factor"])
        if mean is None or std is None:
            return latents / factor
        view = (1, -1, 1, 1, 1)
        mean = torch.tensor(mean).view(view).to(latents.device, latents.dtype)
        std = torch.tensor(std).view(view).to(latents.device, latents.dtype)
        return latents * std / factor + mean

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = to_module(self.vae, self.unnormalise(req.latents))
        req.outputs.frames = video_to_uint8(decode_split(self.vae, latents))
        return req
