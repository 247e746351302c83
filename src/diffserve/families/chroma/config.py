"""Chroma: pipeline constants and sampling defaults (Diffusers' ChromaPipeline semantics)."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChromaPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Latents are packed in 2x2 patches, so pixels must be a multiple of vae_scale * 2.
    latent_patch_size: int = 2
    #: T5 context length upper bound (Diffusers rejects more than 512).
    max_t5_sequence_length: int = 512
    #: Height/width default to this many latent pixels times the VAE's scale factor (Diffusers: 128).
    default_sample_size: int = 128
    #: Image-to-image strength when a request with an input image leaves it unset (Diffusers'
    #: `ChromaImg2ImgPipeline`: 0.9).
    default_strength: float = 0.9
    #: The same with a mask (Diffusers' `ChromaInpaintPipeline`: 0.6).
    default_inpaint_strength: float = 0.6


def chroma_default_sampling_params() -> SamplingParams:
    """Chroma1-HD defaults from Diffusers' ChromaPipeline.__call__: 35 steps, classic CFG at 5.0 (the
    negative prompt defaults to ""), T5 padded to 512 tokens. Height and width follow the VAE."""
    return SamplingParams(num_inference_steps=35, guidance_scale=5.0, max_sequence_length=512)
