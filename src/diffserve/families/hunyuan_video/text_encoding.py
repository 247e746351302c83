"""HunyuanVideo's text encoding, as Diffusers' `HunyuanVideoPipeline.encode_prompt` does it:

- Llama: the prompt in the family's template, padded and truncated to `max_sequence_length + crop_start`
  tokens with its attention mask; the states of the hidden layer `hidden_layers_to_skip` before the last,
  in the encoder's dtype; the first `crop_start` tokens (the template's system part) cut from the states
  and the mask.
- CLIP: the pooled output of the same prompt (Diffusers encodes `prompt`, never `prompt_2`), padded and
  truncated to 77 tokens.

Both come out in the DiT's dtype; the mask travels with the Llama states (`HunyuanVideoConditioning`).
"""

from __future__ import annotations

import torch
from torch import nn

from diffserve.families.hunyuan_video.conditioning import HunyuanVideoConditioning
from diffserve.families.hunyuan_video.config import HunyuanVideoPipelineConfig
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts, tokenize

#: One prompt's encoding: Llama states (1, L, D), their mask (1, L), CLIP's pooled text (1, P).
Encoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class HunyuanVideoTextEncodingStage(Stage):
    needs = ("do_cfg",)
    sets = ("prompt_embeds", "pooled_prompt_embeds", "conditioning.text_mask")

    def __init__(
        self,
        tokenizer,
        text_encoder: nn.Module,
        clip_tokenizer,
        clip_encoder: nn.Module,
        config: HunyuanVideoPipelineConfig,
        output_dtype: torch.dtype,
    ) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.clip_tokenizer = clip_tokenizer
        self.clip_encoder = clip_encoder
        self.config = config
        self.output_dtype = output_dtype
        self.cache = PromptEmbeddingCache()

    @torch.inference_mode()
    def encode_llama(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(prompts), max_sequence_length, dim) Llama states in the encoder's dtype and their bool mask."""
        crop = self.config.crop_start
        device = next(self.text_encoder.parameters()).device
        tokens = self.tokenizer(
            [self.config.prompt_template.format(p) for p in prompts],
            max_length=max_sequence_length + crop,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
            return_attention_mask=True,
        )
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        hidden = self.text_encoder(
            input_ids=ids, attention_mask=mask, output_hidden_states=True
        ).hidden_states
        states = hidden[-(self.config.hidden_layers_to_skip + 1)]
        return states[:, crop:], mask[:, crop:].bool()

    @torch.inference_mode()
    def encode_clip(self, prompts: list[str]) -> torch.Tensor:
        """(len(prompts), dim) CLIP pooled text."""
        device = next(self.clip_encoder.parameters()).device
        ids = tokenize(self.clip_tokenizer, prompts, self.config.clip_max_length, device)
        return self.clip_encoder(ids, output_hidden_states=False).pooler_output

    def encode(self, prompts: list[str], max_sequence_length: int) -> list[Encoded]:
        """Each prompt's (Llama states, mask, pooled CLIP text), the states and pooled in `output_dtype`."""
        states, mask = self.encode_llama(prompts, max_sequence_length)
        pooled = self.encode_clip(prompts)
        states, pooled = states.to(self.output_dtype), pooled.to(self.output_dtype)
        return [
            (states[i : i + 1].clone(), mask[i : i + 1].clone(), pooled[i : i + 1].clone())
            for i in range(len(prompts))
        ]

    def forward(self, req: Req) -> Req:
        msl = req.params.max_sequence_length
        values = self.cache.lookup(request_prompts(req), (msl,), lambda batch: self.encode(batch, msl))
        n = req.params.num_outputs_per_prompt
        conditioning = HunyuanVideoConditioning.of(req)
        req.prompt_embeds = values[0][0].repeat(n, 1, 1)
        conditioning.text_mask = values[0][1].repeat(n, 1)
        req.pooled_prompt_embeds = values[0][2].repeat(n, 1)
        if req.do_cfg:
            req.negative_prompt_embeds = values[1][0].repeat(n, 1, 1)
            conditioning.negative_text_mask = values[1][1].repeat(n, 1)
            req.negative_pooled_prompt_embeds = values[1][2].repeat(n, 1)
        return req
