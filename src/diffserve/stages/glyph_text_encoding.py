"""What the families whose DiT reads Qwen2.5-VL prompt states and ByT5 glyph states share (as Diffusers'
`HunyuanImagePipeline` and `HunyuanVideo15Pipeline` encode them):

- `GlyphTextConditioning`: a request's fixed-length text masks and glyph states with their masks, each
  negative paired with its prompt's (`negative_of`), and `text_branches`, a denoiser's per-branch inputs.
- `QwenGlyphTextEncodingStage`: Qwen2.5-VL reads the prompt formatted by the family (`tokenize`), padded to
  a fixed length; the states of a layer below the last (`text_layers_to_skip`) are kept, minus the
  template's leading tokens, with the padding mask. ByT5 reads the prompt's quoted text as the family
  extracts it (`glyph_text`), padded to a fixed length; a prompt without quotes gives zero states with an
  all-zero mask. Every output is fixed-length, so requests batch without padding; each text's four tensors
  are cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from diffserve.request import Conditioning, Req, role
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts


@dataclass
class GlyphTextConditioning(Conditioning):
    """Each text branch's (batch, tokens) mask of its Qwen2.5-VL states (`Req.prompt_embeds`) and ByT5's
    states of the prompt's quoted text with their mask; the negative branch's are paired with the
    prompt's (`negative_of`), which is all CFG-parallel views need to split them."""

    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds_mask")
    )
    prompt_embeds_2: torch.Tensor | None = None
    negative_prompt_embeds_2: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds_2")
    )
    prompt_embeds_mask_2: torch.Tensor | None = None
    negative_prompt_embeds_mask_2: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds_mask_2")
    )

    def text_branches(self, req: Req) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(text states, mask, glyph states, mask) per branch of `req` (whose conditioning this is) in row
        order: the prompt's, then with CFG the negative's."""
        branches = [
            (req.prompt_embeds, self.prompt_embeds_mask, self.prompt_embeds_2, self.prompt_embeds_mask_2)
        ]
        if req.do_cfg:
            branches.append(
                (
                    req.negative_prompt_embeds,
                    self.negative_prompt_embeds_mask,
                    self.negative_prompt_embeds_2,
                    self.negative_prompt_embeds_mask_2,
                )
            )
        return branches


def glyph_prompt(texts: list[str]) -> str | None:
    """What the glyph encoder reads for quoted `texts`: `Text "a". Text "b". `, or None without any."""
    if not texts:
        return None
    return ". ".join(f'Text "{text}"' for text in texts) + ". "


class GlyphTextStates(NamedTuple):
    """One text's conditioning, each (1, tokens, ...): Qwen2.5-VL states and mask, ByT5 states and mask."""

    states: torch.Tensor
    mask: torch.Tensor
    glyph_states: torch.Tensor
    glyph_mask: torch.Tensor


class QwenGlyphTextEncodingStage(Stage):
    """Sets the prompt's (and with CFG the negative prompt's) states and masks of both encoders, the states
    in `output_dtype` (the DiT's) and the masks in `mask_dtype` (None: the states' dtype), on `device` (the
    DiT's: an offloaded encoder's outputs are wherever it ran). A family gives its `conditioning_type`, how
    it tokenizes prompts for Qwen2.5-VL (`tokenize`), which module runs them (`language_model`) and the
    glyph text of a prompt (`glyph_text`); its config has `text_tokens`, `template_prefix_tokens`,
    `text_layers_to_skip` and `glyph_tokens`."""

    needs = ("do_cfg",)
    sets = (
        "prompt_embeds",
        "conditioning.prompt_embeds_mask",
        "conditioning.prompt_embeds_2",
        "conditioning.prompt_embeds_mask_2",
    )
    conditioning_type: ClassVar[type[GlyphTextConditioning]]
    mask_dtype: ClassVar[torch.dtype | None] = None

    def __init__(
        self,
        tokenizer,
        text_encoder: nn.Module,
        glyph_tokenizer,
        glyph_encoder: nn.Module,
        config,
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

    @staticmethod
    def glyph_text(prompt: str) -> str | None:
        """What the glyph encoder reads for `prompt`, or None when it has no quoted text."""
        raise NotImplementedError

    def tokenize(self, prompts: list[str]):
        """The Qwen2.5-VL inputs (`input_ids`, `attention_mask`) of `prompts`, padded and truncated to
        `text_tokens + template_prefix_tokens`."""
        raise NotImplementedError

    def language_model(self) -> nn.Module:
        """The module that runs the tokens and returns `hidden_states`."""
        return self.text_encoder

    @torch.inference_mode()
    def encode_text(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen2.5-VL: (n, text_tokens, dim) states and the (n, text_tokens) mask of the real tokens."""
        c = self.config
        inputs = self.tokenize(prompts)
        device = next(self.text_encoder.parameters()).device
        mask = inputs["attention_mask"].to(device)
        out = self.language_model()(
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
        texts = {i: text for i, p in enumerate(prompts) if (text := self.glyph_text(p)) is not None}
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

    def encode(self, prompts: list[str]) -> list[GlyphTextStates]:
        """Each prompt's conditioning, both encoders run once over the batch."""
        states, mask = self.encode_text(prompts)
        glyph_states, glyph_mask = self.encode_glyphs(prompts)
        out = {"device": self.device, "dtype": self.output_dtype}
        masks = {"device": self.device, "dtype": self.mask_dtype or self.output_dtype}
        return [
            GlyphTextStates(
                states[i : i + 1].to(**out).clone(),
                mask[i : i + 1].to(**masks),
                glyph_states[i : i + 1].to(**out).clone(),
                glyph_mask[i : i + 1].to(**masks),
            )
            for i in range(len(prompts))
        ]

    def forward(self, req: Req) -> Req:
        values = self.cache.lookup(request_prompts(req), (), self.encode)
        n = req.batch_size
        conditioning = self.conditioning_type.of(req)
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
