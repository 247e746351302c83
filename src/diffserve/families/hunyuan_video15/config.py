"""HunyuanVideo 1.5 family (text-to-video, image-to-video): constants and sampling defaults, as Diffusers'
`HunyuanVideo15Pipeline` / `HunyuanVideo15ImageToVideoPipeline` hard-code them.

The prompt is read by Qwen2.5-VL inside a chat whose system turn describes what a video caption should
cover; the states of that template's leading tokens are dropped. Text in quotes is also read byte by
byte by a ByT5 encoder (the glyph branch), so the model can render it.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams

#: The system turn of the prompt template. The checkpoint was trained with it, including the runs of
#: spaces between the items (Diffusers writes it as a string continued over several source lines).
SYSTEM_MESSAGE = (" " * 9).join(
    [
        "You are a helpful assistant. Describe the video by detailing the following aspects:",
        "1. The main content and theme of the video.",
        "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.",
        "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.",
        "4. background environment, light, style and atmosphere.",
        "5. camera angles, movements, and transitions used in the video.",
    ]
)


@dataclass(frozen=True)
class HunyuanVideo15PipelineConfig:
    """Constants that are not in the checkpoint's config files (Diffusers' pipeline attributes)."""

    system_message: str = SYSTEM_MESSAGE
    #: Leading tokens of the templated prompt whose Qwen2.5-VL states are dropped (the system turn and the
    #: user turn's header with the released tokenizer).
    template_prefix_tokens: int = 108
    #: Qwen2.5-VL tokens kept after the prefix: every prompt is padded (and truncated) to this length.
    text_tokens: int = 1000
    #: The text states are those of the Qwen2.5-VL layer this many layers below the last one.
    text_layers_to_skip: int = 2
    #: ByT5 tokens of the quoted text (padded and truncated to this length).
    glyph_tokens: int = 256
    #: Without a size, text-to-video makes this aspect ratio (width, height) at the DiT's `target_size`.
    default_aspect_ratio: tuple[int, int] = (16, 9)
    #: Output sizes are drawn from buckets of about target_size**2 pixels whose sides are multiples of the
    #: VAE's spatial factor and whose aspect ratio is at most this.
    max_bucket_aspect_ratio: float = 4.0


def hunyuan_video15_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' pipelines' `__call__` (121 frames, 50 steps), at the model's 24 fps. The guidance
    scale default is the folder's guider's (`guider/guider_config.json`), set by the pipeline."""
    return SamplingParams(num_inference_steps=50, num_frames=121, fps=24, video_format="mp4")
