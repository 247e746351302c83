"""HunyuanImage 2.1 family: constants and sampling defaults, as Diffusers' `HunyuanImagePipeline` hard-codes
them, and the one family setting a request may send in `SamplingParams.extra`.

The prompt is read by Qwen2.5-VL inside a fixed chat template whose system turn describes what an image
caption should cover; the states of the template's leading tokens are dropped. Text in quotes is also read
byte by byte by a ByT5 encoder (the glyph branch), so the model can render it.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.option import option
from diffserve.configs.sampling_params import SamplingParams

#: The template the prompt is formatted into (Diffusers' `prompt_template_encode`): a system turn, then the
#: prompt as the user turn, with no assistant turn.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)


@dataclass(frozen=True)
class HunyuanImagePipelineConfig:
    """Constants that are not in the checkpoint's config files (Diffusers' pipeline attributes)."""

    prompt_template: str = PROMPT_TEMPLATE
    #: Leading tokens of the templated prompt whose Qwen2.5-VL states are dropped (the system turn and the
    #: user turn's header with the released tokenizer).
    template_prefix_tokens: int = 34
    #: Qwen2.5-VL tokens kept after the prefix: every prompt is padded (and truncated) to this length.
    text_tokens: int = 1000
    #: The text states are those of the Qwen2.5-VL layer this many layers below the last one.
    text_layers_to_skip: int = 2
    #: ByT5 tokens of the quoted text (padded and truncated to this length).
    glyph_tokens: int = 128
    #: Without a size, images are this many latents a side (times the VAE's factor: 2048 pixels).
    default_latent_size: int = 64
    #: What the DiT's guidance embedding reads is the distilled guidance scale times this.
    guidance_embedding_multiplier: float = 1000.0


def hunyuan_image_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' `__call__` (50 steps). The guidance scale is left unset: the folder's guider
    (`guider`, or `ocr_guider` for a prompt with quoted text) gives it, chosen per request."""
    return SamplingParams(num_inference_steps=50)


@dataclass(frozen=True)
class HunyuanImageSettings:
    """A request's HunyuanImage setting beyond SamplingParams (`SamplingParams.extra`), with Diffusers'
    default. Only guidance-distilled DiTs (`guidance_embeds`) take it; other folders refuse it."""

    distilled_guidance_scale: float = option(
        3.25, min=0, help="guidance scale embedded by guidance-distilled DiTs (Diffusers' default 3.25)"
    )
