"""The text-encoding stage of FLUX.1: CLIP's pooled vector (`pooler_output`, padded to the tokenizer's
max length) and T5's token sequence (padded to `max_sequence_length`), as Diffusers' FluxPipeline does."""

from __future__ import annotations

import torch
from torch import nn

from diffserve.families.flux.conditioning import FluxConditioning
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import encode_request_prompts, tokenize


class FluxTextEncodingStage(Stage):
    """FLUX.1's prompt encoding: CLIP's pooled vector and T5's token sequence, in one batch per request."""

    needs = ("do_cfg",)
    sets = ("prompt_embeds", "pooled_prompt_embeds", "conditioning.text_ids")

    def __init__(
        self,
        clip_tokenizer,
        clip_encoder: nn.Module,
        t5_tokenizer,
        t5_encoder: nn.Module,
        clip_max_length: int,
        output_dtype: torch.dtype,
    ) -> None:
        self.clip_tokenizer = clip_tokenizer
        self.clip_encoder = clip_encoder
        self.t5_tokenizer = t5_tokenizer
        self.t5_encoder = t5_encoder
        self.clip_max_length = clip_max_length
        self.output_dtype = output_dtype
        self.cache = PromptEmbeddingCache()

    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 sequence embeddings (B, L, D), CLIP pooled embeddings (B, P)) for a list of prompts."""
        clip_ids = tokenize(self.clip_tokenizer, prompts, self.clip_max_length, self.clip_encoder.device)
        pooled = self.clip_encoder(clip_ids, output_hidden_states=False).pooler_output
        t5_ids = tokenize(self.t5_tokenizer, prompts, max_sequence_length, self.t5_encoder.device)
        sequence = self.t5_encoder(t5_ids, output_hidden_states=False)[0]
        return sequence.to(self.output_dtype), pooled.to(self.output_dtype)

    def forward(self, req: Req) -> Req:
        encode_request_prompts(req, self.encode, self.cache)
        sequence = req.prompt_embeds
        text_ids = torch.zeros(sequence.shape[1], 3, device=sequence.device, dtype=self.output_dtype)
        FluxConditioning.of(req).text_ids = text_ids
        return req
