"""Stable Diffusion 3 / 3.5 family: pipeline constants and sampling defaults (Diffusers semantics)."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class SD3PipelineConfig:
    clip_max_length: int = 77
    #: Diffusers' StableDiffusion3Pipeline rejects T5 sequences longer than this.
    max_t5_sequence_length: int = 512
    #: Image-to-image / inpainting strength when a request with an input image leaves it unset (Diffusers'
    #: `StableDiffusion3Img2ImgPipeline` and `StableDiffusion3InpaintPipeline`: 0.6).
    default_strength: float = 0.6
    #: Denoising steps when a request with an input image leaves them unset (those two pipelines' default: 50;
    #: text-to-image's is 28), unless the folder's `diffserve.json` sets its own default.
    image_to_image_steps: int = 50


def sd3_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' StableDiffusion3Pipeline.__call__ (height/width follow the checkpoint).
    Skip-layer guidance is off (no `skip_guidance_layers`); its scale and window apply once a request
    lists blocks to skip."""
    return SamplingParams(
        num_inference_steps=28,
        guidance_scale=7.0,
        max_sequence_length=256,
        skip_layer_guidance_scale=2.8,
        skip_layer_guidance_start=0.01,
        skip_layer_guidance_stop=0.2,
    )
