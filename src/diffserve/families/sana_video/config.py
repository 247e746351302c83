"""SANA-Video family (Diffusers' `SanaVideoPipeline`): its fixed facts, sampling defaults and the settings a
request may set in `SamplingParams.extra`, all with the defaults of Diffusers' `__call__`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import SamplingParams

#: The instruction Diffusers' SanaVideoPipeline puts before every prompt by default (its
#: `complex_human_instruction`, written for video): Gemma-2 reads the prompt as the last line of a request
#: to enhance it; the first token and the last max_sequence_length - 1 tokens are kept.
SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION: tuple[str, ...] = (
    "Given a user prompt, generate an 'Enhanced prompt' that provides detailed visual descriptions suitable "
    "for video generation. Evaluate the level of detail in the user prompt:",
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, motion, and "
    "temporal relationships to create vivid and dynamic scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without "
    "overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat slowly settling into a curled "
    "position, peacefully falling asleep on a warm sunny windowsill, with gentle sunlight filtering through "
    "surrounding pots of blooming red flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing "
    "street lamps gradually lighting up, a diverse crowd of people in colorful clothing walking past, and a "
    "double-decker bus smoothly passing by towering glass skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:",
    "User Prompt: ",
)

#: One aspect-ratio bin: (ratio key as Diffusers writes it, height, width), in the table's order.
AspectRatioBin = tuple[str, int, int]

#: SANA-Video's 480p bins (DiT sample_size 30).
ASPECT_RATIO_480_BIN: tuple[AspectRatioBin, ...] = (
    ("0.5", 448, 896),
    ("0.57", 480, 832),
    ("0.68", 528, 768),
    ("0.78", 560, 720),
    ("1.0", 624, 624),
    ("1.13", 672, 592),
    ("1.29", 720, 560),
    ("1.46", 768, 528),
    ("1.67", 816, 496),
    ("1.75", 832, 480),
    ("2.0", 896, 448),
)
#: SANA-Video's 720p bins (DiT sample_size 22).
ASPECT_RATIO_720_BIN: tuple[AspectRatioBin, ...] = (
    ("0.5", 672, 1344),
    ("0.57", 704, 1280),
    ("0.68", 800, 1152),
    ("0.78", 832, 1088),
    ("1.0", 960, 960),
    ("1.13", 1024, 896),
    ("1.29", 1088, 832),
    ("1.46", 1152, 800),
    ("1.67", 1248, 736),
    ("1.75", 1280, 704),
    ("2.0", 1344, 672),
)
#: The DiT's `sample_size` -> the bins Diffusers snaps sizes to (it refuses binning for any other).
BINS_BY_SAMPLE_SIZE: dict[int, tuple[AspectRatioBin, ...]] = {
    30: ASPECT_RATIO_480_BIN,
    22: ASPECT_RATIO_720_BIN,
}


@dataclass(frozen=True)
class SanaVideoPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Wrapped around the prompt (not the negative prompt) before Gemma-2 reads it.
    complex_human_instruction: tuple[str, ...] = SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION
    #: Diffusers' SanaVideoPipeline defaults to 480x832 (height x width).
    default_height: int = 480
    default_width: int = 832
    #: Diffusers requires the generated height and width (after binning) to be multiples of 32.
    pixel_multiple: int = 32


@dataclass(frozen=True)
class SanaVideoSettings:
    """One request's SANA-Video settings beyond SamplingParams (Diffusers' `__call__` arguments, its
    defaults), set in `SamplingParams.extra` and checked by `sana_video_settings`."""

    use_resolution_binning: bool = option(
        True,
        help="generate at the nearest of the model's aspect-ratio bins (480p or 720p), then resize and "
        "centre-crop the video back to the requested size",
    )


#: The keys a SANA-Video request may set in `SamplingParams.extra`.
SANA_VIDEO_EXTRA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(SanaVideoSettings))


def sana_video_settings(params: SamplingParams) -> SanaVideoSettings:
    """The request's settings: Diffusers' defaults overridden by `params.extra` (an unknown key or a bad value
    is an InvalidRequestError naming it)."""
    return settings_from(SanaVideoSettings, params.extra, "extra")


def sana_video_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' SanaVideoPipeline.__call__ (81 frames; 16 fps, its example's)."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=6.0,
        max_sequence_length=300,
        num_frames=81,
        fps=16,
        video_format="mp4",
    )
