"""SANA's text stage: Gemma-2 after SANA's "complex human instruction" (`stages/instructed_gemma_text.py`)."""

from __future__ import annotations

from diffserve.stages.instructed_gemma_text import InstructedGemmaTextEncodingStage


class SanaTextEncodingStage(InstructedGemmaTextEncodingStage):
    """SanaPipeline's prompt encoding, under SANA's own stage name."""
