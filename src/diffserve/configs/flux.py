"""FLUX.1 family: pipeline constants and sampling defaults (Diffusers' FluxPipeline semantics)."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class FluxPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Latents are packed in 2x2 patches, so pixels must be a multiple of vae_scale * 2.
    latent_patch_size: int = 2
    #: CLIP's context length when the tokenizer does not say otherwise.
    clip_max_length: int = 77
    #: T5 context length upper bound (Diffusers rejects more than 512).
    max_t5_sequence_length: int = 512
    #: Height/width default to this many latent pixels times the VAE's scale factor (Diffusers: 128).
    default_sample_size: int = 128


def flux_default_sampling_params() -> SamplingParams:
    """FLUX.1-dev defaults from Diffusers' FluxPipeline.__call__. Height and width stay unset here:
    they follow the VAE (default_sample_size x its scale factor, 1024 for the real FLUX VAE)."""
    return SamplingParams(
        num_inference_steps=28,
        guidance_scale=3.5,
        true_cfg_scale=1.0,
        max_sequence_length=512,
    )
