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
    #: Image-to-image / inpainting strength when a request with an input image leaves it unset
    #: (Diffusers' `FluxImg2ImgPipeline` and `FluxInpaintPipeline`: 0.6).
    default_strength: float = 0.6
    #: Embedded guidance when a request with an input image or a ControlNet leaves it unset (Diffusers'
    #: `FluxImg2ImgPipeline`, `FluxInpaintPipeline` and its ControlNet pipelines: 7.0; `FluxPipeline`'s is
    #: 3.5, `flux_default_sampling_params`). None: the family default for every request.
    conditioned_guidance_scale: float | None = 7.0


def flux_default_sampling_params() -> SamplingParams:
    """FLUX.1-dev defaults from Diffusers' FluxPipeline.__call__. Height and width stay unset here:
    they follow the VAE (default_sample_size x its scale factor, 1024 for the real FLUX VAE). A request
    with an input image or a ControlNet gets `FluxPipelineConfig.conditioned_guidance_scale` instead of
    3.5 (`FluxPipeline.task_defaults`)."""
    return SamplingParams(
        num_inference_steps=28,
        guidance_scale=3.5,
        true_cfg_scale=1.0,
        max_sequence_length=512,
    )


#: FLUX.1 Kontext's training resolutions as (width, height), all about one megapixel (Diffusers'
#: `PREFERRED_KONTEXT_RESOLUTIONS`); an input image is resized to the one nearest its aspect ratio.
KONTEXT_PREFERRED_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)


@dataclass(frozen=True)
class FluxKontextPipelineConfig(FluxPipelineConfig):
    """FLUX.1 Kontext (Diffusers' FluxKontextPipeline): FLUX.1 plus one input image whose latents join the
    image tokens.

    Output size: a request's height and width are used as given. Left unset, they are Diffusers'
    default, the square `default_sample_size` x VAE scale fitted to `max_area` (1024x1024 for the real
    VAE), whatever the input image's shape. (Diffusers also rescales a *given* size to `max_area`;
    diffserve's given size equals Diffusers called with `max_area=height*width`.)
    """

    #: The input image is resized to the preferred resolution nearest its aspect ratio (Diffusers'
    #: `_auto_resize=True`); False keeps its own size (floored to the pixel multiple).
    auto_resize: bool = True
    preferred_resolutions: tuple[tuple[int, int], ...] = KONTEXT_PREFERRED_RESOLUTIONS
    #: Pixels of the default output size (Diffusers' `max_area`).
    max_area: int = 1024 * 1024
    #: Every Kontext request has its input image; Diffusers' `FluxKontextPipeline` defaults to 3.5 with it.
    conditioned_guidance_scale: float | None = None


@dataclass(frozen=True)
class FluxFillPipelineConfig(FluxPipelineConfig):
    """FLUX.1 Fill (Diffusers' FluxFillPipeline): inpainting and outpainting with an input image and a
    mask, which its DiT reads as extra channels of every image token. Diffusers' default strength is 1.0
    (start from pure noise; the mask and the masked image condition the DiT)."""

    default_strength: float = 1.0
    #: Every Fill request has its input image; Diffusers' `FluxFillPipeline` defaults to 30 with it.
    conditioned_guidance_scale: float | None = None


def flux_fill_default_sampling_params() -> SamplingParams:
    """FLUX.1-Fill-dev defaults from Diffusers' FluxFillPipeline.__call__: 50 steps, embedded guidance 30."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=30.0,
        true_cfg_scale=1.0,
        max_sequence_length=512,
    )
