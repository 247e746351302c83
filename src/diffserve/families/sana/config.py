"""SANA family (Diffusers' `SanaPipeline`): pipeline constants and sampling defaults."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import SamplingParams

#: The instruction Diffusers' SanaPipeline puts before every prompt by default (its
#: `complex_human_instruction`, from SANA's app config): Gemma-2 reads the prompt as the last line of
#: a request to enhance it. Only the prompt's tokens and the instruction's first token are kept.
SANA_COMPLEX_HUMAN_INSTRUCTION: tuple[str, ...] = (
    "Given a user prompt, generate an 'Enhanced prompt' that provides detailed visual descriptions suitable "
    "for image generation. Evaluate the level of detail in the user prompt:",
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
    "relationships to create vivid and concrete scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without "
    "overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping "
    "peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing "
    "street lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering "
    "glass skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:",
    "User Prompt: ",
)


@dataclass(frozen=True)
class SanaPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Wrapped around the prompt (not the negative prompt) before Gemma-2 reads it; empty: the bare prompt.
    complex_human_instruction: tuple[str, ...] = SANA_COMPLEX_HUMAN_INSTRUCTION
    #: Height and width when a request leaves them unset (Diffusers' SanaPipeline: 1024 for every model).
    default_size: int = 1024


@dataclass(frozen=True)
class SanaSettings:
    """One request's SANA / SANA-Sprint settings beyond SamplingParams (Diffusers' `__call__` arguments, its
    defaults), set in `SamplingParams.extra` and checked by `sana_settings`."""

    use_resolution_binning: bool = option(
        True,
        help="generate at the aspect-ratio bin nearest the requested size (the bins of the DiT's sample_size), "
        "then resize and centre-crop the images back to it; any height and width is accepted then, otherwise "
        "they must be multiples of the model's pixel granularity (32)",
    )


def sana_settings(params: SamplingParams) -> SanaSettings:
    """The request's settings: Diffusers' defaults overridden by `params.extra` (an unknown key or a bad value
    is an InvalidRequestError naming it)."""
    return settings_from(SanaSettings, params.extra, "extra")


def sana_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' SanaPipeline.__call__ (negative prompt "" when guidance_scale > 1)."""
    return SamplingParams(num_inference_steps=20, guidance_scale=4.5, max_sequence_length=300)


@dataclass(frozen=True)
class SanaSprintPipelineConfig(SanaPipelineConfig):
    """SANA-Sprint (Diffusers' SanaSprintPipeline): SANA's text and VAE, a guidance-embedding consistency DiT
    sampled by SCM in a few steps, no negative prompt. Resolution binning takes the 1024 px bins only (a DiT
    of sample_size 32)."""

    #: The first SCM angle (pi/2: pure noise) and, for two steps, the one in between (Diffusers' defaults).
    #: Other step counts take evenly spaced angles, as Diffusers called with `intermediate_timesteps=None`.
    max_timesteps: float = 1.57080
    intermediate_timesteps: float = 1.3


def sana_sprint_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' SanaSprintPipeline.__call__ (the guidance scale is embedded, not CFG)."""
    return SamplingParams(num_inference_steps=2, guidance_scale=4.5, max_sequence_length=300)
