"""Z-Image's text conditioning: the prompt as a Qwen3 chat turn, second-to-last layer's hidden states.

Diffusers pads every prompt to `max_sequence_length` (512) tokens before running Qwen3 and then keeps
only the real tokens. Qwen3 attends causally, so right-padding cannot change the real tokens' states;
diffserve pads only to the longest prompt in the batch (truncating at `max_sequence_length`), which
runs the encoder on a few dozen tokens instead of 512 for typical prompts.
"""

from __future__ import annotations

import torch
from torch import nn

from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts, set_sequence_embeds


class ZImageTextEncodingStage(Stage):
    needs = ("do_cfg",)
    sets = ("prompt_embeds",)

    def __init__(self, tokenizer, text_encoder: nn.Module, output_dtype: torch.dtype) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.output_dtype = output_dtype
        self.cache = PromptEmbeddingCache()

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
