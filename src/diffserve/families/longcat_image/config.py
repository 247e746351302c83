"""LongCat-Image family: constants, sampling defaults and the per-request settings, with the defaults of
Diffusers' `LongCatImagePipeline.__call__` (one deliberate exception: `enable_prompt_rewrite`, below), and
LongCat-Image-Edit's (`LongCatImageEditPipeline`: no renormalisation, no rewriting, the output size
following the input image's aspect ratio at about one megapixel).

Guidance: CFG runs when guidance_scale > 1, as two branches against the negative prompt ("" by default),
then, by default, renormalises each image token's guided prediction to at most the prompt branch's norm
(`enable_cfg_renorm`, the scale floored at `cfg_renorm_min`). SamplingParams has no fields for those: a
request sets them in `SamplingParams.extra` (`LONGCAT_IMAGE_EXTRA_KEYS`), and `longcat_image_settings`
checks them.

Prompt rewriting: Diffusers' pipeline defaults to `enable_prompt_rewrite=True`, which has the Qwen2.5-VL
text encoder generate a longer prompt (up to 512 new tokens) before encoding it. diffserve does not
generate text, so it defaults to False and refuses True by name; send the rewritten prompt itself. A
Diffusers call with `enable_prompt_rewrite=False` is what diffserve's output equals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError

#: The chat turn the prompt's tokens are put in; the hidden states of both parts are dropped after encoding.
PROMPT_PREFIX = (
    "<|im_start|>system\nAs an image captioning expert, generate a descriptive text prompt based on an image "
    "content, suitable for input to a text-to-image model.<|im_end|>\n<|im_start|>user\n"
)
PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
#: LongCat-Image-Edit's: the input image's vision block ends the prefix (`<|image_pad|>` stands for its vision
#: tokens); the block's states are kept, from `<|vision_start|>` on, with the prompt's.
EDIT_PROMPT_PREFIX = (
    "<|im_start|>system\nAs an image editing expert, first analyze the content and attributes of the input "
    "image(s). Then, based on the user's editing instructions, clearly and precisely determine how to modify "
    "the given image(s), ensuring that only the specified parts are altered and all other aspects remain "
    "consistent with the original(s).<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
)


@dataclass(frozen=True)
class LongCatImagePipelineConfig:
    """Constants that are not in the checkpoint's config files."""

    prompt_prefix: str = PROMPT_PREFIX
    prompt_suffix: str = PROMPT_SUFFIX
    #: Every prompt is truncated or padded to this many tokens (the DiT attends to the padding too), and the
    #: image's position ids start after them.
    tokenizer_max_length: int = 512
    #: Latents are packed in 2x2 patches, so pixels must be a multiple of the VAE's scale times 2.
    latent_patch_size: int = 2
    #: Height/width default to this many latent pixels times the VAE's scale factor (1024 for the real VAE).
    default_sample_size: int = 128
    #: The DiT's latent channels before packing (Diffusers' pipeline hard-codes 16).
    latent_channels: int = 16


@dataclass(frozen=True)
class LongCatImageEditPipelineConfig(LongCatImagePipelineConfig):
    """LongCat-Image-Edit: one input image, shown to the text encoder (at half the output's sides) and
    appended to the image tokens as VAE latents."""

    prompt_prefix: str = EDIT_PROMPT_PREFIX
    #: Unless a request sets height and width, the output has about this many pixels at the input
    #: image's aspect ratio, each side rounded up to `size_multiple` (Diffusers' `calculate_dimensions`).
    output_area: int = 1024 * 1024
    size_multiple: int = 16


def edit_output_size(image_width: int, image_height: int, area: int, multiple: int) -> tuple[int, int]:
    """(height, width) of about `area` pixels at the image's aspect ratio, each side rounded up to `multiple`."""
    ratio = image_width / image_height
    width = math.sqrt(area * ratio)
    height = width / ratio

    def round_up(side: float) -> int:
        return int(side) if side % multiple == 0 else (int(side // multiple) + 1) * multiple

    return round_up(height), round_up(width)


def edit_default_size(
    params: SamplingParams, area: int, multiple: int, pixel_multiple: int
) -> tuple[int, int]:
    """(height, width) of an edit whose request leaves them unset: `edit_output_size` of its input image.

    With the released VAE (8x) that size is always a multiple of the folder's pixel multiple (16). A deeper
    VAE needs coarser sides, and Diffusers then makes an image a few pixels smaller than the size it resizes
    the input to, from a second resize of that input: diffserve refuses such a request, naming the size to
    set instead, rather than giving another image."""
    height, width = edit_output_size(*params.input_images[0].size, area, multiple)
    unset = {"height": (params.height, height), "width": (params.width, width)}
    if any(value is None and default % pixel_multiple for value, default in unset.values()):
        floored = f"{height // pixel_multiple * pixel_multiple}x{width // pixel_multiple * pixel_multiple}"
        raise InvalidRequestError(
            f"LongCat-Image-Edit's default output size for this input image, {height}x{width} (about "
            f"{area} pixels at its aspect ratio, sides rounded up to {multiple}), is not a multiple of "
            f"{pixel_multiple}, this folder's pixel granularity: set height and width (for example "
            f"{floored})",
            param="height",
        )
    return height, width


def longcat_image_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' LongCatImagePipeline.__call__: 50 steps, guidance_scale 4.5 (CFG on, with the
    "" negative prompt), 512 prompt tokens."""
    return SamplingParams(num_inference_steps=50, guidance_scale=4.5, max_sequence_length=512)


def longcat_image_edit_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' LongCatImageEditPipeline.__call__: 50 steps, guidance_scale 4.5."""
    return SamplingParams(num_inference_steps=50, guidance_scale=4.5, max_sequence_length=512)


@dataclass(frozen=True)
class LongCatImageSettings:
    """One request's LongCat-Image settings beyond SamplingParams, under Diffusers' keyword names."""

    enable_cfg_renorm: bool = option(
        True, help="renormalise each token's guided prediction to at most the prompt branch's norm"
    )
    cfg_renorm_min: float = option(
        0.0, min=0, max=1, help="the smallest renormalisation scale (1.0 turns it off)"
    )
    enable_prompt_rewrite: bool = option(
        False, help="have the text encoder rewrite the prompt first (not supported: False only)"
    )


#: The keys a LongCat-Image request may set in `SamplingParams.extra`.
LONGCAT_IMAGE_EXTRA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(LongCatImageSettings))


def longcat_image_settings(params: SamplingParams) -> LongCatImageSettings:
    """The request's settings: the defaults, overridden by `params.extra` (checked against the declarations;
    an unknown key, a bad value or `enable_prompt_rewrite=True` is an InvalidRequestError naming it)."""
    settings = settings_from(LongCatImageSettings, params.extra, "extra", LONGCAT_IMAGE_EXTRA_KEYS)
    if settings.enable_prompt_rewrite:
        raise InvalidRequestError(
            "extra['enable_prompt_rewrite']=True is not supported by LongCat-Image in diffserve: rewriting "
            "generates a new prompt with the text encoder, which diffserve does not do; send the rewritten "
            "prompt instead (diffserve equals Diffusers called with enable_prompt_rewrite=False)",
            param="extra",
        )
    return settings
