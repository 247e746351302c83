"""HiDream-I1's text encoding, as Diffusers' `HiDreamImagePipeline.encode_prompt` does it with one prompt for
every encoder (its `prompt_2..4` default to `prompt`, its negative ones to `negative_prompt`):

- pooled: the two CLIP encoders' projected (`text_embeds`) outputs, concatenated, each over the prompt
  padded and truncated to min(max_sequence_length, 218) tokens, run without a mask;
- T5: the last hidden states over min(max_sequence_length, the tokenizer's limit) tokens, with the mask;
- Llama: the hidden states after each of its layers (`hidden_states[1:]`, stacked on a first axis) over
  min(max_sequence_length, the tokenizer's limit) tokens, padded with its end-of-text token, with the mask.
  No chat template: the prompt as it is, after the tokenizer's begin-of-text token.
The DiT attends to every token, padding included (no mask reaches it).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from diffserve.families.hidream.conditioning import HiDreamConditioning
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts

logger = logging.getLogger("diffserve.stages")


class HiDreamText(NamedTuple):
    """One or more prompts' encodings: T5 (B, L5, D5), Llama (layers, B, Ll, Dl), pooled CLIP (B, P)."""

    t5: torch.Tensor
    llama: torch.Tensor
    pooled: torch.Tensor

    def row(self, i: int) -> HiDreamText:
        return HiDreamText(
            self.t5[i : i + 1].clone(), self.llama[:, i : i + 1].clone(), self.pooled[i : i + 1].clone()
        )


def tokens(
    tokenizer, prompts: list[str], max_length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of `prompts` padded and truncated to `max_length`, warning when one was cut."""
    out = tokenizer(
        prompts,
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    longer = tokenizer(prompts, max_length=max_length + 1, truncation=True).input_ids
    if any(len(row) > max_length for row in longer):
        logger.warning("prompt truncated to %d tokens for %s", max_length, type(tokenizer).__name__)
    return out.input_ids.to(device), out.attention_mask.to(device)


class HiDreamTextEncodingStage(Stage):
    needs = ("do_cfg",)
    sets = ("prompt_embeds", "pooled_prompt_embeds", "conditioning.llama_states")

    def __init__(
        self,
        clip_tokenizers: tuple,
        clip_encoders: tuple[nn.Module, nn.Module],
        t5_tokenizer,
        t5_encoder: nn.Module,
        llama_tokenizer,
        llama_encoder: nn.Module,
        clip_max_length: int,
        output_dtype: torch.dtype,
    ) -> None:
        self.clip_tokenizers = clip_tokenizers
        self.clip_encoders = clip_encoders
        self.t5_tokenizer = t5_tokenizer
        self.t5_encoder = t5_encoder
        # Diffusers' pipeline pads Llama prompts with its end-of-text token (the tokenizer has no pad token).
        llama_tokenizer.pad_token = llama_tokenizer.eos_token
        self.llama_tokenizer = llama_tokenizer
        self.llama_encoder = llama_encoder
        self.clip_max_length = clip_max_length
        self.output_dtype = output_dtype
        self.cache = PromptEmbeddingCache()

    @staticmethod
    def _device(module: nn.Module) -> torch.device:
        return next(module.parameters()).device

    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> HiDreamText:
        pooled = []
        clip_length = min(max_sequence_length, self.clip_max_length)
        for tokenizer, encoder in zip(self.clip_tokenizers, self.clip_encoders, strict=True):
            ids, _ = tokens(tokenizer, prompts, clip_length, self._device(encoder))
            pooled.append(encoder(ids)[0].to(self.output_dtype))
        t5_length = min(max_sequence_length, self.t5_tokenizer.model_max_length)
        ids, mask = tokens(self.t5_tokenizer, prompts, t5_length, self._device(self.t5_encoder))
        t5 = self.t5_encoder(ids, attention_mask=mask)[0]
        llama_length = min(max_sequence_length, self.llama_tokenizer.model_max_length)
        ids, mask = tokens(self.llama_tokenizer, prompts, llama_length, self._device(self.llama_encoder))
        # The hidden states are all that is used: the language-model head runs on the last token only.
        out = self.llama_encoder(ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
        llama = torch.stack(out.hidden_states[1:], dim=0)
        return HiDreamText(t5.to(self.output_dtype), llama.to(self.output_dtype), torch.cat(pooled, dim=-1))

    def forward(self, req: Req) -> Req:
        msl = req.params.max_sequence_length

        def rows(batch: list[str]) -> list[HiDreamText]:
            encoded = self.encode(batch, msl)
            return [encoded.row(i) for i in range(len(batch))]

        values = self.cache.lookup(request_prompts(req), (msl,), rows)
        n = req.params.num_outputs_per_prompt
        conditioning = HiDreamConditioning.of(req)
        req.prompt_embeds = values[0].t5.repeat(n, 1, 1)
        req.pooled_prompt_embeds = values[0].pooled.repeat(n, 1)
        conditioning.llama_states = values[0].llama.repeat(1, n, 1, 1)
        if req.do_cfg:
            req.negative_prompt_embeds = values[1].t5.repeat(n, 1, 1)
            req.negative_pooled_prompt_embeds = values[1].pooled.repeat(n, 1)
            conditioning.negative_llama_states = values[1].llama.repeat(1, n, 1, 1)
        return req
