"""Z-Image family: constants and sampling defaults (Diffusers' ZImagePipeline semantics).

Guidance: CFG runs when guidance_scale > 0 and combines as `positive + scale * (positive - negative)`
(so 0 means no CFG, unlike SD3's 1), with "" as the default negative prompt. Z-Image-Turbo is meant
to run without CFG (guidance_scale 0, about 9 steps); its folder can say so in diffserve.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class ZImagePipelineConfig:
    #: Height/width default to 1024 (Diffusers' ZImagePipeline).
    default_pixels: int = 1024
    max_sequence_length_limit: int = 1024
    #: Strength when a request with an input image leaves it unset: Diffusers' `ZImageImg2ImgPipeline`
    #: (0.6), and `ZImageInpaintPipeline` with a mask (1.0).
    default_strength: float = 0.6
    default_inpaint_strength: float = 1.0


def z_image_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' ZImagePipeline.__call__."""
    return SamplingParams(num_inference_steps=50, guidance_scale=5.0, max_sequence_length=512)
