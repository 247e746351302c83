"""HunyuanImage 2.1's text conditioning, as Diffusers' `HunyuanImagePipeline.encode_prompt`:

- Qwen2.5-VL reads the prompt formatted into the family's template, padded to a fixed length; the states of
  a layer below the last (`text_layers_to_skip`) are kept, minus the template's leading tokens, with the
  padding mask (the DiT leaves padded tokens out itself).
- ByT5 reads the prompt's quoted text ('...', "...", ‘...’ and “...”, each kind in turn) as
  `Text "a". Text "b". `, padded to a fixed length; a prompt without quotes gives zero states with an
  all-zero mask.

The encoding itself is `stages/glyph_text_encoding.py`'s, shared with the other families whose DiT reads
these states: every output is fixed-length, so requests batch without padding; each text's four tensors are
cached.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from diffserve.families.hunyuan_image.conditioning import HunyuanImageConditioning
from diffserve.families.hunyuan_image.config import HunyuanImagePipelineConfig
from diffserve.stages.glyph_text_encoding import QwenGlyphTextEncodingStage, glyph_prompt

#: The quote pairs the glyph text is read from, in Diffusers' order: all single-quoted texts first, then
#: double, then Chinese single and Chinese double quotes.
QUOTE_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(pattern) for pattern in (r"'(.*?)'", r'"(.*?)"', r"‘(.*?)’", r"“(.*?)”")
)


def glyph_text(prompt: str) -> str | None:
    """What the glyph encoder reads for `prompt`: its quoted texts (repeats kept) as
    `Text "a". Text "b". `, or None without quotes."""
    return glyph_prompt([text for pattern in QUOTE_PATTERNS for text in pattern.findall(prompt)])


class HunyuanImageTextEncodingStage(QwenGlyphTextEncodingStage):
    """Sets the prompt's (and with CFG the negative prompt's) states and masks of both encoders, the states
    in `output_dtype` (the DiT's) and the masks as int64, on `device` (the DiT's: an offloaded encoder's
    outputs are wherever it ran)."""

    conditioning_type = HunyuanImageConditioning
    mask_dtype = torch.int64
    glyph_text = staticmethod(glyph_text)

    def tokenize(self, prompts: list[str]):
        """The prompts formatted into the family's template."""
        c: HunyuanImagePipelineConfig = self.config
        return self.tokenizer(
            [c.prompt_template.format(p) for p in prompts],
            max_length=c.text_tokens + c.template_prefix_tokens,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )

    def language_model(self) -> nn.Module:
        """The language model without the LM head (its hidden states are the same)."""
        return self.text_encoder.model
