"""HunyuanVideo 1.5's text conditioning, as Diffusers' `HunyuanVideo15Pipeline.encode_prompt`:

- Qwen2.5-VL reads the prompt as the user turn of a chat with the family's system turn, padded to a fixed
  length; the states of a layer below the last (`text_layers_to_skip`) are kept, minus the template's
  leading tokens, with the padding mask (the DiT drops padded tokens itself).
- ByT5 reads the prompt's quoted text ("..." or “...”) as `Text "a". Text "b". `, padded to a fixed length;
  a prompt without quotes gives zero states with an all-zero mask.

Every output is fixed-length, so requests batch without padding. Each text's four tensors are cached.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from diffserve.families.hunyuan_video15.conditioning import HunyuanVideo15Conditioning
from diffserve.families.hunyuan_video15.config import HunyuanVideo15PipelineConfig
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts

#: Text between straight double quotes, or between curly ones.
QUOTED_TEXT = re.compile(r"\"(.*?)\"|“(.*?)”")


def glyph_text(prompt: str) -> str | None:
    """What the glyph encoder reads for `prompt`: its quoted texts (repeats dropped when there are several)
    as `Text "a". Text "b". `, or None without quotes."""
    texts = [straight or curly for straight, curly in QUOTED_TEXT.findall(prompt)]
    if len(texts) > 1:
        texts = list(dict.fromkeys(texts))
    if not texts:
        return None
    return ". ".join(f'Text "{text}"' for text in texts) + ". "


class TextConditioning(NamedTuple):
    """One text's conditioning, each (1, tokens, ...): Qwen2.5-VL states and mask, ByT5 states and mask."""

    states: torch.Tensor
    mask: torch.Tensor
    glyph_states: torch.Tensor
    glyph_mask: torch.Tensor


class HunyuanVideo15TextEncodingStage(Stage):
    """Sets the prompt's (and with CFG the negative prompt's) states and masks of both encoders, in
    `output_dtype` (the DiT's; the masks too, as Diffusers passes them) on `device` (the DiT's: an
    offloaded encoder's outputs are wherever it ran)."""

    needs = ("do_cfg",)
    sets = (
        "prompt_embeds",
        "conditioning.prompt_embeds_mask",
        "conditioning.prompt_embeds_2",
        "conditioning.prompt_embeds_mask_2",
    )

    def __init__(
        self,
        tokenizer,
        text_encoder: nn.Module,
        glyph_tokenizer,
        glyph_encoder: nn.Module,
        config: HunyuanVideo15PipelineConfig,
        output_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.glyph_tokenizer = glyph_tokenizer
        self.glyph_encoder = glyph_encoder
        self.config = config
        self.output_dtype = output_dtype
        self.device = device
        self.cache = PromptEmbeddingCache()

    @torch.inference_mode()
    def encode_text(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen2.5-VL: (n, text_tokens, dim) states and the (n, text_tokens) mask of the real tokens."""
        c = self.config
        chats = [
            [{"role": "system", "content": c.system_message}, {"role": "user", "content": p or " "}]
            for p in prompts
        ]
        inputs = self.tokenizer.apply_chat_template(
            chats,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            padding="max_length",
            max_length=c.text_tokens + c.template_prefix_tokens,
            truncation=True,
            return_tensors="pt",
        )
        device = next(self.text_encoder.parameters()).device
        mask = inputs["attention_mask"].to(device)
        out = self.text_encoder(
            input_ids=inputs["input_ids"].to(device), attention_mask=mask, output_hidden_states=True
        )
        states = out.hidden_states[-(c.text_layers_to_skip + 1)]
        return states[:, c.template_prefix_tokens :], mask[:, c.template_prefix_tokens :]

    @torch.inference_mode()
    def encode_glyphs(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """ByT5: (n, glyph_tokens, d_model) states and mask; zeros for prompts without quoted text."""
        length = self.config.glyph_tokens
        param = next(self.glyph_encoder.parameters())
        states = torch.zeros(len(prompts), length, self.glyph_encoder.config.d_model, dtype=param.dtype)
        masks = torch.zeros(len(prompts), length, dtype=torch.int64)
        states, masks = states.to(param.device), masks.to(param.device)
        texts = {i: text for i, p in enumerate(prompts) if (text := glyph_text(p)) is not None}
        if texts:
            tokens = self.glyph_tokenizer(
                list(texts.values()),
                padding="max_length",
                max_length=length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).to(param.device)
            rows = torch.tensor(list(texts), device=param.device)
            encoded = self.glyph_encoder(
                input_ids=tokens.input_ids, attention_mask=tokens.attention_mask.float()
            ).last_hidden_state
            states[rows] = encoded.to(states)
            masks[rows] = tokens.attention_mask.to(masks.device)
        return states, masks

    def encode(self, prompts: list[str]) -> list[TextConditioning]:
        """Each prompt's conditioning in `output_dtype`, both encoders run once over the batch."""
        states, mask = self.encode_text(prompts)
        glyph_states, glyph_mask = self.encode_glyphs(prompts)
        out = {"device": self.device, "dtype": self.output_dtype}
        return [
            TextConditioning(
                states[i : i + 1].to(**out).clone(),
                mask[i : i + 1].to(**out),
                glyph_states[i : i + 1].to(**out).clone(),
                glyph_mask[i : i + 1].to(**out),
            )
            for i in range(len(prompts))
        ]

    def forward(self, req: Req) -> Req:
        values = self.cache.lookup(request_prompts(req), (), self.encode)
        n = req.batch_size
        conditioning = HunyuanVideo15Conditioning.of(req)
        positive = values[0]
        req.prompt_embeds = positive.states.repeat(n, 1, 1)
        conditioning.prompt_embeds_mask = positive.mask.repeat(n, 1)
        conditioning.prompt_embeds_2 = positive.glyph_states.repeat(n, 1, 1)
        conditioning.prompt_embeds_mask_2 = positive.glyph_mask.repeat(n, 1)
        if req.do_cfg:
            negative = values[1]
            req.negative_prompt_embeds = negative.states.repeat(n, 1, 1)
            conditioning.negative_prompt_embeds_mask = negative.mask.repeat(n, 1)
            conditioning.negative_prompt_embeds_2 = negative.glyph_states.repeat(n, 1, 1)
            conditioning.negative_prompt_embeds_mask_2 = negative.glyph_mask.repeat(n, 1)
        return req
