"""Qwen-Image 2.1's fixed facts (its prompt templates, sizes) and the defaults of Diffusers'
`QwenImage21Pipeline.__call__`."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import MAX_IMAGE_SIDE, SamplingParams

#: The system turn of every prompt; its tokens' hidden states are dropped (Diffusers' `sys_prompt`).
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
#: The text-to-image template, a raw string (not the processor's chat template: the two tokenize
#: differently and the checkpoint was trained on this one).
TEXT_TO_IMAGE_TEMPLATE = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
#: One condition image's vision slots in the user turn (1-based index); images after the first are
#: preceded by a space, and all of them by the prompt (Diffusers' `prompt_template_ti2i`).
IMAGE_SLOT = "<image{}><|vision_start|><|image_pad|><|vision_end|>"
#: Model-index key of the author's sampling sigmas (terminal sigma excluded); their count is the step count.
SAMPLE_SIGMAS_KEY = "sample_sigmas"


@dataclass(frozen=True)
class QwenImage21PipelineConfig:
    """Constants that are not in the checkpoint's config files."""

    template: str = TEXT_TO_IMAGE_TEMPLATE
    image_slot: str = IMAGE_SLOT
    system_prompt: str = SYSTEM_PROMPT
    #: Height and width default to this, or to about this squared in pixels at the last condition
    #: image's aspect ratio, the size condition images are resized to (Diffusers' `output_resolution`).
    default_resolution: int = 1024
    #: Pixels per latent pixel (Diffusers hard-codes 16: the VAE's compression; the DiT is unpatched).
    vae_scale_factor: int = 16


def qwen_image21_default_sampling_params(steps: int = 40) -> SamplingParams:
    """Diffusers' defaults: 40 steps (or the folder's `sample_sigmas` count, `steps`), true_cfg_scale 1
    (the model is meant to be sampled without guidance: CFG needs true_cfg_scale > 1 and a negative prompt)."""
    return SamplingParams(num_inference_steps=steps, true_cfg_scale=1.0)


@dataclass(frozen=True)
class QwenImage21Settings:
    """A request's own Qwen-Image 2.1 settings (`SamplingParams.extra`), Diffusers' `__call__` arguments."""

    output_resolution: int | None = option(
        None,
        min=32,
        max=MAX_IMAGE_SIDE,
        help="side length in pixels whose square is the area condition images are resized to, and the default "
        "size (square without images, else the last image's aspect ratio); unset: the pipeline's (1024)",
    )


def qwen_image21_settings(params: SamplingParams) -> QwenImage21Settings:
    """The request's settings from `params.extra` (an unknown key or a bad value: InvalidRequestError)."""
    return settings_from(QwenImage21Settings, params.extra, "extra")


def output_resolution(params: SamplingParams, default: int) -> int:
    """The request's `output_resolution` (Diffusers' argument of that name), else `default`."""
    chosen = qwen_image21_settings(params).output_resolution
    return default if chosen is None else chosen
