"""Gemma-2 prompt encoding after a "complex human instruction", as Diffusers' SanaPipeline and
SanaVideoPipeline both do it (each family passes its own instruction and names its stage): Gemma-2's last
hidden states of the lower-cased prompt, read after the instruction.

The prompt is the instruction's last line (`"User Prompt: " + prompt`), tokenized right-padded to the
instruction's token count + max_sequence_length - 2; of its states only the first token's (`<bos>`) and
the last max_sequence_length - 1 are kept, which are the instruction's last tokens, then the prompt's
(SANA paper, section 3.1). The negative prompt is read bare, padded to max_sequence_length.

Diffusers keeps the padding positions and masks them in the DiT's cross-attention (a -10000 bias,
which gives them a softmax weight of exactly 0). Here each text keeps only its real tokens, which the
mask always puts first: the DiT sees the same weights, and texts of different lengths are padded and
masked again only where they share a batch (the families' pipelines).
"""

from __future__ import annotations

import torch
from torch import nn

from diffserve.request import Req
from diffserve.stages.text_encoding import CachedTextEncodingStage


def preprocess(text: str) -> str:
    """Diffusers' `_text_preprocessing` with `clean_caption=False` (its default): lower case, stripped."""
    return text.lower().strip()


class InstructedGemmaTextEncodingStage(CachedTextEncodingStage):
    """Base of the SANA families' text stages (each subclass is its stage's name in logs and metrics)."""

    def __init__(
        self,
        tokenizer,
        text_encoder: nn.Module,
        complex_human_instruction: tuple[str, ...],
        output_dtype: torch.dtype,
    ) -> None:
        """`complex_human_instruction`: its lines, joined by newlines, go before every prompt (not the
        negative prompt); empty: prompts are read bare, as Diffusers with `complex_human_instruction=None`."""
        super().__init__(tokenizer, text_encoder, output_dtype)
        self.instruction = "\n".join(complex_human_instruction) if complex_human_instruction else None
        # Diffusers counts the instruction's tokens with its `<bos>`.
        self.instruction_tokens = len(tokenizer.encode(self.instruction)) if self.instruction else 0

    def longest_sequence(self, max_sequence_length: int) -> int:
        """Tokens Gemma-2 reads for a prompt at this max_sequence_length."""
        if self.instruction is None:
            return max_sequence_length
        return self.instruction_tokens + max_sequence_length - 2

    @torch.inference_mode()
    def encode(self, texts: list[str], max_sequence_length: int, instructed: bool) -> list[torch.Tensor]:
        """One (1, real tokens, hidden) tensor per text: a prompt (`instructed`) after the instruction,
        with Diffusers' token selection, or a negative prompt as it is."""
        texts = [preprocess(t) for t in texts]
        length = max_sequence_length
        if instructed and self.instruction is not None:
            texts = [self.instruction + t for t in texts]
            length = self.longest_sequence(max_sequence_length)
        inputs = self.tokenizer(
            texts,
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            padding_side="right",
            return_tensors="pt",
        )
        device = next(self.text_encoder.parameters()).device
        mask = inputs.attention_mask.to(device)
        states = self.text_encoder(inputs.input_ids.to(device), attention_mask=mask)[0]
        if instructed:
            # Diffusers selects these for every prompt; without an instruction they are all its tokens.
            keep = [0, *range(-max_sequence_length + 1, 0)]
            states, mask = states[:, keep], mask[:, keep]
        out = []
        for row_states, row_mask in zip(states, mask.bool(), strict=True):
            real = int(row_mask.sum())
            if not bool(row_mask[:real].all()):
                raise RuntimeError(
                    f"{type(self).__name__}: the text mask is expected to keep its real tokens first"
                )
            out.append(row_states[None, :real].to(self.output_dtype))
        return out

    def forward(self, req: Req) -> Req:
        p = req.params
        n = p.num_outputs_per_prompt

        def encoder(instructed: bool):
            return lambda batch: self.encode(batch, p.max_sequence_length, instructed)

        settings = (p.max_sequence_length,)
        (prompt,) = self.cache.lookup([p.prompt], ("prompt", *settings), encoder(True))
        req.prompt_embeds = prompt.repeat(n, 1, 1)
        if req.do_cfg:
            (negative,) = self.cache.lookup([p.negative_prompt], ("negative", *settings), encoder(False))
            req.negative_prompt_embeds = negative.repeat(n, 1, 1)
        return req
