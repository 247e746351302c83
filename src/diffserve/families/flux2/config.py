"""FLUX.2 family (Diffusers' `Flux2Pipeline`, FLUX.2-dev, and `Flux2KleinPipeline`, FLUX.2 [klein] 4B/9B):
pipeline constants and sampling defaults.

Both take a prompt and, optionally, reference images (multi-reference editing): each reference image is
VAE-encoded and its tokens join the DiT's image tokens. dev reads its prompt with Mistral Small 3.1
(`Mistral3ForConditionalGeneration`) in a chat with BFL's system message and runs embedded guidance;
klein reads it with Qwen3 and runs real classifier-free guidance against the empty prompt, unless the
checkpoint is step-distilled (model_index.json `is_distilled`). The DiT sees three of the encoder's
intermediate hidden states, concatenated per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams

#: BFL's system message for prompt encoding (Diffusers' `SYSTEM_MESSAGE`, a fact of the released model:
#: FLUX.2-dev was trained on prompts read in this conversation). Its line break is part of it.
FLUX2_SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)


@dataclass(frozen=True)
class Flux2PipelineConfig:
    """FLUX.2-dev constants that are not in the checkpoint's config files (Diffusers' values)."""

    #: Latents are 2x2-patchified into tokens, so pixels must be a multiple of vae_scale * 2.
    latent_patch_size: int = 2
    #: Height/width default to this many latent pixels times the VAE scale (1024 for the real VAE), or to
    #: the first reference image's size when one is given.
    default_sample_size: int = 128
    #: Upper bound users may set for max_sequence_length: the text is padded to it, and every padded
    #: token is a DiT token; BFL's reference code and Diffusers' default use 512.
    max_sequence_length_limit: int = 512
    #: The text encoder's hidden states the DiT reads (`text_encoder_out_layers`; index 0 is the
    #: embedding output), concatenated per token in this order.
    text_encoder_out_layers: tuple[int, ...] = (10, 20, 30)
    #: The system turn of the prompt's chat (None: a plain user turn, as klein's).
    system_message: str | None = FLUX2_SYSTEM_MESSAGE
    #: A reference image above this many pixels is first resized to it at its aspect ratio.
    reference_max_area: int = 1024 * 1024
    #: Diffusers' `check_image_input` bounds for reference images.
    reference_min_side: int = 64
    reference_max_aspect_ratio: float = 8.0
    #: Reference images one request may send. Diffusers sets no bound; BFL documents up to 10 for FLUX.2.
    max_input_images: int = 10
    #: Reference image i's tokens carry the time id `reference_time_offset * (i + 1)`; the noisy
    #: tokens have time 0 (Diffusers' `_prepare_image_ids(scale=10)`).
    reference_time_offset: int = 10


@dataclass(frozen=True)
class Flux2KleinPipelineConfig(Flux2PipelineConfig):
    """FLUX.2 [klein] (Diffusers' `Flux2KleinPipeline`): a Qwen3 text encoder read at layers 9, 18 and 27
    of a plain user turn (chat template with thinking off), true CFG against the empty prompt."""

    text_encoder_out_layers: tuple[int, ...] = (9, 18, 27)
    system_message: str | None = None


def flux2_default_sampling_params() -> SamplingParams:
    """FLUX.2-dev defaults from Diffusers' `Flux2Pipeline.__call__`: 50 steps, embedded guidance 4.
    Height and width stay unset: they follow the first reference image, else the VAE (1024)."""
    return SamplingParams(num_inference_steps=50, guidance_scale=4.0, max_sequence_length=512)


def flux2_klein_default_sampling_params() -> SamplingParams:
    """FLUX.2 [klein] defaults from Diffusers' `Flux2KleinPipeline.__call__`: 50 steps, CFG scale 4 against
    the empty negative prompt (Diffusers always uses ""; diffserve also accepts another `negative_prompt`).
    A step-distilled checkpoint runs without CFG (its model card recommends 4 steps; Diffusers' default
    stays 50, and so does this one: a folder's diffserve.json can lower it)."""
    return SamplingParams(
        num_inference_steps=50, guidance_scale=4.0, negative_prompt="", max_sequence_length=512
    )


def flux2_klein_distilled_sampling_params() -> SamplingParams:
    """A step-distilled klein checkpoint: no CFG (a guidance_scale above 1 is refused), otherwise klein's
    defaults."""
    return SamplingParams(num_inference_steps=50, max_sequence_length=512)
