"""Wan's text conditioning: UMT5 states of the cleaned prompt. UMT5 masks the padding, so it runs on
the batch's longest prompt only; the states are zero-padded to `max_sequence_length`, as in Diffusers."""

from __future__ import annotations

import html
import re

import torch

from diffserve.stages.text_encoding import SequenceTextEncodingStage

try:  # Diffusers fixes mojibake with ftfy when it is installed; do the same so prompts match.
    import ftfy
except ImportError:  # pragma: no cover - depends on the environment
    ftfy = None


def clean_prompt(text: str) -> str:
    """Diffusers' Wan prompt cleaning: ftfy (if installed), HTML entities unescaped twice, whitespace collapsed."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class WanTextEncodingStage(SequenceTextEncodingStage):
    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """(len(prompts), max_sequence_length, dim): real tokens' states, then zeros."""
        inputs = self.tokenizer(
            [clean_prompt(p) for p in prompts],
            padding="longest",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = next(self.text_encoder.parameters()).device
        mask = inputs.attention_mask.to(device)
        states = self.text_encoder(inputs.input_ids.to(device), mask).last_hidden_state.to(self.output_dtype)
        out = states.new_zeros(len(prompts), max_sequence_length, states.shape[-1])
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            out[i, :length] = states[i, :length]
        return out
