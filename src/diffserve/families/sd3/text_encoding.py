"""SD3's text encoding, as Diffusers does: sequence = [CLIP-L ; CLIP-G] penultimate states, zero-padded
to T5's width, then T5's tokens; pooled = [CLIP-L pooled ; CLIP-G pooled]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import encode_request_prompts, tokenize


class SD3TextEncodingStage(Stage):
    needs = ("do_cfg",)
    sets = ("prompt_embeds", "pooled_prompt_embeds")

    def __init__(
        self,
        clip_tokenizers: tuple,
        clip_encoders: tuple[nn.Module, nn.Module],
        t5_tokenizer,
        t5_encoder: nn.Module | None,
        clip_max_length: int,
        output_dtype: torch.dtype,
        joint_attention_dim: int,
    ) -> None:
        """`t5_encoder` may be None (a folder without text_encoder_3): its tokens are then zeros."""
        self.clip_tokenizers = clip_tokenizers
        self.clip_encoders = clip_encoders
        self.t5_tokenizer = t5_tokenizer
        self.t5_encoder = t5_encoder
        self.clip_max_length = clip_max_length
        self.output_dtype = output_dtype
        self.joint_attention_dim = joint_attention_dim
        self.cache = PromptEmbeddingCache()

    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence embeddings (B, 2*77 + L, D_t5), pooled embeddings (B, P_l + P_g))."""
        sequences, pooled = [], []
        for tokenizer, encoder in zip(self.clip_tokenizers, self.clip_encoders, strict=True):
            ids = tokenize(tokenizer, prompts, self.clip_max_length, encoder.device)
            out = encoder(ids, output_hidden_states=True)
            pooled.append(out[0])
            sequences.append(out.hidden_states[-2])
        clip = torch.cat(sequences, dim=-1)
        if self.t5_encoder is None:
            t5 = clip.new_zeros(len(prompts), max_sequence_length, self.joint_attention_dim)
        else:
            t5_ids = tokenize(self.t5_tokenizer, prompts, max_sequence_length, self.t5_encoder.device)
            t5 = self.t5_encoder(t5_ids)[0]
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        sequence = torch.cat([clip, t5], dim=-2)
        return sequence.to(self.output_dtype), torch.cat(pooled, dim=-1).to(self.output_dtype)

    def forward(self, req: Req) -> Req:
        encode_request_prompts(req, self.encode, self.cache)
        return req
