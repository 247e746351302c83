"""Z-Image family: constants and sampling defaults (Diffusers' ZImagePipeline semantics).

Guidance: CFG runs when guidance_scale > 0 and combines as `positive + scale * (positive - negative)`
(so 0 means no CFG, unlike SD3's 1), with "" as the default negative prompt. Z-Image-Turbo is meant
to run without CFG (guidance_scale 0, about 9 steps); its folder can say so in diffserve.json.

Diffusers' two CFG refinements are request settings in `SamplingParams.extra` (`Z_IMAGE_EXTRA_KEYS`,
checked by `z_image_settings`), under its keyword names and with its defaults: `cfg_truncation` (CFG
is dropped at the steps whose DiT time `1 - t / 1000` is above it) and `cfg_normalization` (the guided
prediction's norm is capped at that multiple of the prompt branch's, over the whole latent).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from diffserve.configs.option import option, settings_from
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


@dataclass(frozen=True)
class ZImageSettings:
    """One request's Z-Image settings beyond SamplingParams (Diffusers' `ZImagePipeline.__call__` keywords)."""

    cfg_truncation: float | None = option(
        1.0,
        help="CFG only at the steps whose DiT time 1 - t/1000 is at most this (above 1 or null: every step)",
    )
    cfg_normalization: float = option(
        0.0,
        help="cap the guided prediction's norm at this multiple of the prompt branch's (0 or false: off; "
        "true: 1.0)",
    )


#: The keys a Z-Image request may set in `SamplingParams.extra`.
Z_IMAGE_EXTRA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(ZImageSettings))


def z_image_settings(params: SamplingParams) -> ZImageSettings:
    """The request's settings: the defaults, overridden by `params.extra` (checked against the declarations;
    an unknown key or a bad value is an InvalidRequestError naming it). Diffusers types
    `cfg_normalization` as a bool and reads it as `float(value)`: true is 1.0 and false 0.0 here too."""
    extra = dict(params.extra)
    if isinstance(extra.get("cfg_normalization"), bool):
        extra["cfg_normalization"] = float(extra["cfg_normalization"])
    return settings_from(ZImageSettings, extra, "extra", Z_IMAGE_EXTRA_KEYS)


def cfg_truncated(dit_time: float, cfg_truncation: float | None) -> bool:
    """Whether CFG is dropped at a step of DiT time `dit_time` (`1 - t / 1000`): Diffusers drops it where
    that time is above `cfg_truncation`, when the setting is given and at most 1."""
    return cfg_truncation is not None and cfg_truncation <= 1 and dit_time > cfg_truncation
