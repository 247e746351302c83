"""Qwen-Image 2.1's prompt states from Qwen3-VL, as Diffusers' `QwenImage21Pipeline` reads them.

The prompt goes into the raw text-to-image template (an empty prompt becomes " ": Qwen has no BOS token to
read), through the processor (left padding) and the language model with its attention mask. The states
kept are the last decoder layer's output *before* the model's final RMSNorm (what the DiT was trained on;
transformers 5 would return them normalised, so the norm is bypassed for the call), of the real tokens,
minus the leading system turn: as many tokens as the processor's chat template gives the system message
alone (Diffusers' `_drop_idx`). Each prompt is encoded on its own, as Diffusers encodes one prompt per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts, set_sequence_embeds


def system_token_count(processor: Callable, system_prompt: str) -> int:
    """Tokens of the system message alone under the processor's chat template (Diffusers' `_drop_idx`);
    a ValueError where the processor has none (the folder's `chat_template.jinja`), as the count cannot be
    known."""
    if getattr(processor, "chat_template", None) is None:
        raise ValueError(
            "QwenImage21Pipeline: the processor folder has no chat template (chat_template.jinja or .json), "
            "which sets how many system-turn states are dropped"
        )
    message = [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}]
    return len(processor.apply_chat_template(message, tokenize=True, return_dict=False)[0])


def language_model(text_encoder: nn.Module) -> nn.Module:
    """The decoder stack of a Qwen3-VL model (its `language_model`)."""
    return getattr(text_encoder.model, "language_model", text_encoder.model)


class QwenImage21TextEncodingStage(Stage):
    needs = ("do_cfg",)
    sets = ("prompt_embeds",)

    def __init__(
        self,
        processor: Callable,
        text_encoder: nn.Module,
        template: str,
        system_prompt: str,
        dtype: torch.dtype,
    ) -> None:
        self.processor = processor
        self.text_encoder = text_encoder
        self.template = template
        self.dtype = dtype
        self.drop = system_token_count(processor, system_prompt)
        self.cache = PromptEmbeddingCache()

    @torch.inference_mode()
    def encode_one(self, prompt: str) -> torch.Tensor:
        """(tokens, hidden) states of one prompt."""
        text = self.template.format(prompt or " ")
        inputs = self.processor(text=[text], padding=True, padding_side="left", return_tensors="pt")
        inputs = inputs.to(next(self.text_encoder.parameters()).device)
        extra = {"mm_token_type_ids": inputs["mm_token_type_ids"]} if "mm_token_type_ids" in inputs else {}
        norm = language_model(self.text_encoder).norm
        handle = norm.register_forward_hook(lambda _module, args, _output: args[0])  # the pre-norm states
        try:
            states = self.text_encoder.model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **extra
            ).last_hidden_state
        finally:
            handle.remove()
        mask = inputs["attention_mask"][0].bool()
        return states[0][mask][self.drop :].to(self.dtype)

    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        return [self.encode_one(prompt) for prompt in prompts]

    def forward(self, req: Req) -> Req:
        embeds = self.cache.lookup(request_prompts(req), (), self.encode)
        set_sequence_embeds(req, [e[None] for e in embeds])
        return req
