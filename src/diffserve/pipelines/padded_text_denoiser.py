"""The denoising step of pipelines whose DiT embeds each text branch once per request and reads the batch's
texts right-padded under a mask (SANA's linear-attention DiTs, image and video).

Every request's prompt and negative-prompt branches go through one DiT forward. Each branch keeps only
its real tokens, so branches and requests may differ in text length: the denoiser embeds each branch
once per request (`embed_context`, kept on `req.dit_context`), right-pads the embedded texts to the
longest in the batch and masks the padding, which the DiT's cross-attention then weighs exactly 0.
Latents and the scheduler stay float32 whatever the DiT's dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch

from diffserve.layers.lora_rows import request_lora_scope
from diffserve.models.schedulers.dpm_solver_flow import DPMSolverFlowScheduler
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.scm import SCMScheduler
from diffserve.models.step_cache import BatchStepCache
from diffserve.pipelines.cfg_batch import (
    advance_requests,
    branch_texts,
    gather_branches,
    pad_text,
    split_guided,
    step_cache_for,
)
from diffserve.request import Req

#: The flow schedulers these denoisers step.
FlowScheduler = DPMSolverFlowScheduler | FlowMatchEulerScheduler | SCMScheduler


class LatentChannels(Protocol):
    """The DiT config keys the denoiser reads: its latent channels in and out."""

    in_channels: int
    out_channels: int | None


class PaddedTextDiT(Protocol):
    """A DiT that embeds a text branch once (`embed_context`) and reads the embedded texts, right-padded,
    with a 0/1 mask: called with `hidden_states`, `encoder_hidden_states=None`, `encoder_attention_mask`,
    `timestep`, `context` and `step_cache`."""

    config: LatentChannels

    def embed_context(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, **inputs: torch.Tensor | BatchStepCache | None) -> torch.Tensor:
        """The prediction for `forward`'s keyword inputs (the denoiser's call gives them)."""


class PaddedTextDenoiser:
    """One classic-CFG step over a list of requests (same latent grid), each at its own timestep."""

    def __init__(self, transformer: PaddedTextDiT, scheduler: FlowScheduler, dtype: torch.dtype) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.dtype = dtype
        config = transformer.config
        # A DiT predicting a learned variance too: Diffusers keeps the first half of its channels.
        self.learned_sigma = int(config.out_channels) // 2 == int(config.in_channels)

    def context_for(self, req: Req) -> list[torch.Tensor]:
        """The request's text branches through the DiT's caption embedder, once per request (each branch
        keeps its own length; the batch pads them)."""
        if req.dit_context is None:
            with request_lora_scope(req.loras):
                req.dit_context = [self.transformer.embed_context(text) for text in branch_texts(req)]
        return req.dit_context

    def dit_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        """The DiT's timestep input for the batch's scheduler timesteps: as they are (a pipeline whose DiT
        reads them scaled overrides this)."""
        return timesteps

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        context, mask = pad_text([branch for req in reqs for branch in self.context_for(req)])
        # float32 latents and timesteps, on the latents' device since timestep preparation.
        prediction = self.transformer(
            hidden_states=torch.cat(batch.latents).to(self.dtype),
            encoder_hidden_states=None,
            encoder_attention_mask=mask,
            timestep=self.dit_timestep(torch.cat(batch.timesteps)),
            context=context,
            step_cache=step_cache_for(reqs),  # rows in `gather_branches` order, as it expects
        ).float()
        if self.learned_sigma:
            prediction = prediction.chunk(2, dim=1)[0]
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))
