"""HunyuanVideo's fixed facts and the defaults of Diffusers' `HunyuanVideoPipeline.__call__`."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams

#: Diffusers' default prompt template (`DEFAULT_PROMPT_TEMPLATE`): the Llama chat turns that wrap a prompt.
PROMPT_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)


@dataclass(frozen=True)
class HunyuanVideoPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Diffusers' `__call__` default size.
    default_height: int = 720
    default_width: int = 1280
    #: The template the Llama encoder reads each prompt in.
    prompt_template: str = PROMPT_TEMPLATE
    #: Leading Llama tokens (the template's system part) cut from the states and the mask; the
    #: tokenizer's length budget is `max_sequence_length + crop_start`.
    crop_start: int = 95
    #: The Llama states are those of the hidden layer this many before the last (`hidden_states[-3]`).
    hidden_layers_to_skip: int = 2
    #: Llama tokens of the prompt by default (padded and truncated to this many after the crop).
    default_max_sequence_length: int = 256
    #: CLIP's token budget for the pooled text (fixed in Diffusers' pipeline).
    clip_max_length: int = 77
    #: The embedded guidance reaches the DiT multiplied by this (Diffusers' `guidance_scale * 1000`).
    guidance_multiplier: float = 1000.0
    #: The frame rate Diffusers' example exports at.
    fps: int = 15


def hunyuan_video_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' `HunyuanVideoPipeline.__call__`: 50 steps, embedded guidance 6, true CFG off
    (scale 1), 129 frames, 256 Llama tokens."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=6.0,
        true_cfg_scale=1.0,
        max_sequence_length=HunyuanVideoPipelineConfig.default_max_sequence_length,
        num_frames=129,
        fps=HunyuanVideoPipelineConfig.fps,
        video_format="mp4",
    )
