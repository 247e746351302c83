"""What the SANA and SANA-Video parity files' text-encoding tests share: one prompt after the instruction
and one bare negative prompt, encoded by diffserve's text stage and by Diffusers' `encode_prompt`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import SanaPipeline, SanaVideoPipeline

from diffserve.stages.instructed_gemma_text import InstructedGemmaTextEncodingStage

PROMPT = "A Red fox"
NEGATIVE_PROMPT = "ugly and blurry"

#: diffserve's states (real tokens only), Diffusers' states (padded) and Diffusers' mask.
Encoding = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def prompt_and_negative_encodings(
    stage: InstructedGemmaTextEncodingStage,
    reference: SanaPipeline | SanaVideoPipeline,
    instruction: Sequence[str],
    max_sequence_length: int,
) -> tuple[Encoding, Encoding]:
    """`PROMPT` after `instruction` and the bare `NEGATIVE_PROMPT`, at `max_sequence_length` tokens, on both
    sides: (prompt's encoding, negative prompt's encoding)."""
    ref, ref_mask, ref_neg, ref_neg_mask = reference.encode_prompt(
        PROMPT,
        True,
        negative_prompt=NEGATIVE_PROMPT,
        max_sequence_length=max_sequence_length,
        complex_human_instruction=instruction,
    )
    (prompt,) = stage.encode([PROMPT], max_sequence_length, instructed=True)
    (negative,) = stage.encode([NEGATIVE_PROMPT], max_sequence_length, instructed=False)
    return (prompt, ref, ref_mask), (negative, ref_neg, ref_neg_mask)
