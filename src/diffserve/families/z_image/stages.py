"""Z-Image's own stages. Text conditioning: the prompt as a Qwen3 chat turn, second-to-last layer's states of the real tokens.
Qwen3 is causal, so padding only to the batch's longest prompt (Diffusers: to 512) changes nothing.
Timesteps: sigmas from a float32 linspace(1, 1/n) as Diffusers, and the DiT's own time axis 1 - t / 1000,
which also decides the steps `cfg_truncation` drops CFG at (each step's CFG scale, on the host)."""

from __future__ import annotations

import torch

from diffserve.families.z_image.conditioning import ZImageConditioning
from diffserve.families.z_image.config import cfg_truncated, z_image_settings
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.text_encoding import CachedTextEncodingStage, request_prompts, set_sequence_embeds
from diffserve.stages.timestep_preparation import set_schedule


class ZImageTextEncodingStage(CachedTextEncodingStage):
    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> list[torch.Tensor]:
        """One (tokens, hidden) tensor per prompt, real tokens only."""
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for prompt in prompts
        ]
        inputs = self.tokenizer(
            texts, padding="longest", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        )
        device = next(self.text_encoder.parameters()).device
        mask = inputs.attention_mask.to(device).bool()
        out = self.text_encoder(
            input_ids=inputs.input_ids.to(device), attention_mask=mask, output_hidden_states=True
        )
        states = out.hidden_states[-2]
        return [states[i][mask[i]].to(self.output_dtype) for i in range(len(prompts))]

    def forward(self, req: Req) -> Req:
        msl = req.params.max_sequence_length
        embeds = self.cache.lookup(request_prompts(req), (msl,), lambda batch: self.encode(batch, msl))
        set_sequence_embeds(req, [e[None] for e in embeds])
        return req


class ZImageTimestepPreparationStage(Stage):
    """Z-Image semantics: sigmas from a float32 linspace(1, 1/n) (as Diffusers), the DiT's 1 - t / 1000, and
    the request's CFG scale per step with its `cfg_normalization` (`ZImageConditioning`)."""

    needs = ("latents", "latent_size")
    sets = (
        "schedule",
        "conditioning.dit_timesteps",
        "conditioning.cfg_scales",
        "conditioning.cfg_normalization",
    )

    def __init__(self, scheduler: FlowMatchEulerScheduler) -> None:
        self.scheduler = scheduler

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        tokens = (req.latent_size.height // 2) * (req.latent_size.width // 2)
        mu = self.scheduler.resolution_shift_mu(tokens)
        base_sigmas = torch.linspace(1.0, 1 / steps, steps).tolist()
        schedule = self.scheduler.schedule(steps, mu=mu, sigmas=base_sigmas)
        set_schedule(req, schedule)
        dit_times = (1000 - schedule.timesteps) / 1000
        conditioning = ZImageConditioning.of(req)
        conditioning.dit_timesteps = dit_times.to(req.latents.device)
        settings = z_image_settings(req.params)
        # Diffusers compares each step's float32 time, as a Python float, with the setting.
        conditioning.cfg_scales = [
            0.0 if cfg_truncated(t, settings.cfg_truncation) else req.cfg_scale
            for t in dit_times.float().tolist()
        ]
        conditioning.cfg_normalization = settings.cfg_normalization
        return req
