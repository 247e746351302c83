"""Qwen-Image family (text-to-image and edit): prompt templates, constants and sampling defaults.

The templates are the model's own conditioning format (the checkpoint was trained with them); the
text encoder's hidden states for the template's system part are dropped, so only the user turn
conditions the DiT. Values follow Diffusers' QwenImagePipeline / QwenImageEditPipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams

TEXT_TO_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)

#: Qwen-Image-Edit-Plus: the user turn starts with one "Picture i:" vision block per input image.
EDIT_PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
EDIT_PLUS_IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class QwenImagePipelineConfig:
    """Constants that are not in the checkpoint's config files."""

    prompt_template: str = TEXT_TO_IMAGE_TEMPLATE
    #: Tokens of the template before the user's text; their hidden states are dropped.
    template_prefix_tokens: int = 34
    #: Prompt tokens kept by the tokenizer (after the template prefix).
    tokenizer_max_length: int = 1024
    #: Upper bound users may set for max_sequence_length (Diffusers rejects more than 1024).
    max_sequence_length_limit: int = 1024
    #: Height/width default to this many latent pixels times the VAE scale (1024 for the real VAE).
    default_sample_size: int = 128
    #: Image-to-image / inpainting strength when a request with an input image leaves it unset (Diffusers'
    #: `QwenImageImg2ImgPipeline` and `QwenImageInpaintPipeline`: 0.6).
    default_strength: float = 0.6


@dataclass(frozen=True)
class QwenImageEditPipelineConfig(QwenImagePipelineConfig):
    prompt_template: str = EDIT_TEMPLATE
    template_prefix_tokens: int = 64
    #: The input image is resized to about this many pixels at its own aspect ratio (sides rounded
    #: to 32) before the VAE encodes it; the output defaults to the same size (of the last image).
    condition_image_area: int = 1024 * 1024
    #: Pixels of the copy the vision-language encoder reads; None: the VAE's copy.
    vision_image_area: int | None = None
    #: Per-image text put before the prompt (with "{}" for the 1-based index); None: none.
    image_prompt_template: str | None = None
    max_input_images: int = 1


@dataclass(frozen=True)
class QwenImageEditPlusPipelineConfig(QwenImageEditPipelineConfig):
    """Several input images; the text encoder sees each at ~384x384, the VAE at ~1024x1024."""

    prompt_template: str = EDIT_PLUS_TEMPLATE
    vision_image_area: int | None = 384 * 384
    image_prompt_template: str | None = EDIT_PLUS_IMAGE_PROMPT
    #: The model card recommends one to three input images.
    max_input_images: int = 3


def qwen_image_default_sampling_params() -> SamplingParams:
    """Diffusers' defaults (50 steps, true_cfg_scale 4) with one deliberate difference: the negative
    prompt defaults to " " (the model card's usage) so true CFG is on by default; Diffusers leaves it
    unset, which silently turns CFG off. Send `true_cfg_scale=1` to run without CFG."""
    return SamplingParams(
        num_inference_steps=50, true_cfg_scale=4.0, negative_prompt=" ", max_sequence_length=512
    )
