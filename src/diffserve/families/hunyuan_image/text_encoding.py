"""HunyuanImage 2.1's text conditioning, as Diffusers' `HunyuanImagePipeline.encode_prompt`:

- Qwen2.5-VL reads the prompt formatted into the family's template, padded to a fixed length; the states of
  a layer below the last (`text_layers_to_skip`) are kept, minus the template's leading tokens, with the
  padding mask (the DiT leaves padded tokens out itself).
- ByT5 reads the prompt's quoted text ('...', "...", ‘...’ and “...”, each kind in turn) as
  `Text "a". Text "b". `, padded to a fixed length; a prompt without quotes gives zero states with an
  all-zero mask.

Every output is fixed-length, so requests batch without padding. Each text's four tensors are cached.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from diffserve.families.hunyuan_image.conditioning import HunyuanImageConditioning
from diffserve.families.hunyuan_image.config import HunyuanImagePipelineConfig
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts

#: The quote pairs the glyph text is read from, in Diffusers' order: all single-quoted texts first, then
#: double, then Chinese single and Chinese double quotes.
QUOTE_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(pattern) for pattern in (r"'(.*?)'", r'"(.*?)"', r"‘(.*?)’", r"“(.*?)”")
)


def glyph_text(prompt: str) -> str | None:
    """What the glyph encoder reads for `prompt`: its quoted texts (repeats kept) as
    `Text "a". Text "b". `, or None without quotes."""
    texts = [text for pattern in QUOTE_PATTERNS for text in pattern.findall(prompt)]
    if not texts:
        return None
    return ". ".join(f'Text "{text}"' for text in texts) + ". "


class HunyuanImageTextStates(NamedTuple):
    """One text's conditioning, each (1, tokens, ...): Qwen2.5-VL states and mask, ByT5 states and mask."""

    states: torch.Tensor
    mask: torch.Tensor
    glyph_states: torch.Tensor
    glyph_mask: torch.Tensor


class HunyuanImageTextEncodingStage(Stage):
    """Sets the prompt's (and with CFG the negative prompt's) states and masks of both encoders, the states
    in `output_dtype` (the DiT's) and the masks as int64, on `device` (the DiT's: an offloaded encoder's
    outputs are wherever it ran)."""

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
        config: HunyuanImagePipelineConfig,
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
        """Qwen2.5-VL: (n, text_tokens, dim) states and the (n, text_tokens) mask of the real tokens. The
        language model runs without the LM head (its hidden states are the same)."""
        c = self.config
        inputs = self.tokenizer(
            [c.prompt_template.format(p) for p in prompts],
            max_length=c.text_tokens + c.template_prefix_tokens,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )
        device = next(self.text_encoder.parameters()).device
        mask = inputs["attention_mask"].to(device)
        out = self.text_encoder.model(
            input_ids=inputs["input_ids"].to(device), attention_mask=mask, output_hidden_states=True
        )
        states = out.hidden_states[-(c.text_layers_to_skip + 1)]
        return states[:, c.template_prefix_tokens :], mask[:, c.template_prefix_tokens :]

    @torch.inference_mode()
    def encode_glyphs(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """ByT5: (n, glyph_tokens, d_model) states and int64 mask; zeros for prompts without quoted text."""
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
            masks[rows] = tokens.attention_mask.to(masks)
        return states, masks

    def encode(self, prompts: list[str]) -> list[HunyuanImageTextStates]:
        """Each prompt's conditioning, both encoders run once over the batch."""
        states, mask = self.encode_text(prompts)
        glyph_states, glyph_mask = self.encode_glyphs(prompts)
        out = {"device": self.device, "dtype": self.output_dtype}
        return [
            HunyuanImageTextStates(
                states[i : i + 1].to(**out).clone(),
                mask[i : i + 1].to(self.device),
                glyph_states[i : i + 1].to(**out).clone(),
                glyph_mask[i : i + 1].to(self.device),
            )
            for i in range(len(prompts))
        ]

    def forward(self, req: Req) -> Req:
        values = self.cache.lookup(request_prompts(req), (), self.encode)
        n = req.batch_size
        conditioning = HunyuanImageConditioning.of(req)
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
