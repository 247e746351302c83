"""HunyuanVideo 1.5's text conditioning, as Diffusers' `HunyuanVideo15Pipeline.encode_prompt`:

- Qwen2.5-VL reads the prompt as the user turn of a chat with the family's system turn, padded to a fixed
  length; the states of a layer below the last (`text_layers_to_skip`) are kept, minus the template's
  leading tokens, with the padding mask (the DiT drops padded tokens itself).
- ByT5 reads the prompt's quoted text ("..." or “...”) as `Text "a". Text "b". `, padded to a fixed length;
  a prompt without quotes gives zero states with an all-zero mask.

The encoding itself is `stages/glyph_text_encoding.py`'s, shared with the other families whose DiT reads
these states: every output is fixed-length, so requests batch without padding; each text's four tensors are
cached.
"""

from __future__ import annotations

import re

from diffserve.families.hunyuan_video15.conditioning import HunyuanVideo15Conditioning
from diffserve.families.hunyuan_video15.config import HunyuanVideo15PipelineConfig
from diffserve.stages.glyph_text_encoding import QwenGlyphTextEncodingStage, glyph_prompt

#: Text between straight double quotes, or between curly ones.
QUOTED_TEXT = re.compile(r"\"(.*?)\"|“(.*?)”")


def glyph_text(prompt: str) -> str | None:
    """What the glyph encoder reads for `prompt`: its quoted texts (repeats dropped when there are several)
    as `Text "a". Text "b". `, or None without quotes."""
    texts = [straight or curly for straight, curly in QUOTED_TEXT.findall(prompt)]
    if len(texts) > 1:
        texts = list(dict.fromkeys(texts))
    return glyph_prompt(texts)


class HunyuanVideo15TextEncodingStage(QwenGlyphTextEncodingStage):
    """Sets the prompt's (and with CFG the negative prompt's) states and masks of both encoders, in
    `output_dtype` (the DiT's; the masks too, as Diffusers passes them) on `device` (the DiT's: an
    offloaded encoder's outputs are wherever it ran)."""

    conditioning_type = HunyuanVideo15Conditioning
    glyph_text = staticmethod(glyph_text)

    def tokenize(self, prompts: list[str]):
        """The prompts as the user turns of chats with the family's system turn."""
        c: HunyuanVideo15PipelineConfig = self.config
        chats = [
            [{"role": "system", "content": c.system_message}, {"role": "user", "content": p or " "}]
            for p in prompts
        ]
        return self.tokenizer.apply_chat_template(
            chats,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            padding="max_length",
            max_length=c.text_tokens + c.template_prefix_tokens,
            truncation=True,
            return_tensors="pt",
        )
