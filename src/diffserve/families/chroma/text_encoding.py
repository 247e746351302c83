"""Chroma's text encoding: T5 over the prompt padded to `max_sequence_length`, with the tokenizer's mask
given to T5, and the DiT's text mask (the prompt's tokens plus one padding token kept), as Diffusers'
ChromaPipeline encodes a prompt."""

from __future__ import annotations

import logging

import torch

from diffserve.families.chroma.conditioning import ChromaConditioning
from diffserve.request import Req
from diffserve.stages.text_encoding import CachedTextEncodingStage, request_prompts, set_sequence_embeds

logger = logging.getLogger("diffserve.stages")


class ChromaTextEncodingStage(CachedTextEncodingStage):
    """T5 states and the DiT's text mask per branch (prompt, and the negative prompt with CFG)."""

    sets = ("prompt_embeds", "conditioning.text_ids", "conditioning.text_mask")

    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 states (B, L, D), the DiT's text mask (B, L): 1 up to and including the first padding
        token) for `prompts`, padded and truncated to L = `max_sequence_length`."""
        inputs = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_overflowing_tokens=False,
            return_tensors="pt",
        )
        device = self.text_encoder.device
        token_mask = inputs.attention_mask.to(device)
        if bool((token_mask.sum(dim=1) == max_sequence_length).any()):
            longer = self.tokenizer(prompts, max_length=max_sequence_length + 1, truncation=True).input_ids
            if any(len(row) > max_sequence_length for row in longer):
                logger.warning("prompt truncated to %d tokens for %s", max_sequence_length, "T5")
        states = self.text_encoder(
            inputs.input_ids.to(device), attention_mask=token_mask, output_hidden_states=False
        )[0]
        lengths = token_mask.sum(dim=1, keepdim=True)
        positions = torch.arange(max_sequence_length, device=device).unsqueeze(0)
        dit_mask = (positions <= lengths).to(self.output_dtype)
        return states.to(self.output_dtype), dit_mask

    def forward(self, req: Req) -> Req:
        p = req.params
        n = p.num_outputs_per_prompt

        def rows(batch: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            states, mask = self.encode(batch, p.max_sequence_length)
            return [(states[i : i + 1].clone(), mask[i : i + 1].clone()) for i in range(len(batch))]

        values = self.cache.lookup(request_prompts(req), (p.max_sequence_length,), rows)
        set_sequence_embeds(req, [states for states, _ in values])
        conditioning = ChromaConditioning.of(req)
        conditioning.text_mask = values[0][1].repeat(n, 1)
        if req.do_cfg:
            conditioning.negative_text_mask = values[1][1].repeat(n, 1)
        sequence = req.prompt_embeds
        conditioning.text_ids = torch.zeros(
            sequence.shape[1], 3, device=sequence.device, dtype=self.output_dtype
        )
        return req
