"""LTX-2 family (Diffusers `LTX2Pipeline`, `LTX2ImageToVideoPipeline`): constants, sampling defaults and the
per-request guidance settings, all with the defaults of Diffusers' `__call__`.

LTX-2 guides each modality with up to three terms on top of its prediction, all on by default: classic CFG
against the negative prompt (`guidance_scale` for the video, `audio_guidance_scale` for the audio),
spatio-temporal guidance (STG: the prediction minus one with the self-attention of
`spatio_temporal_guidance_blocks` replaced by its values) and modality guidance (minus one with the
audio<->video attention off), then rescales the guided prediction towards the prompt's std
(`guidance_rescale`). SamplingParams has fields for the first only; the others are LTX-2 settings a
request may set in `SamplingParams.extra` (`LTX2_EXTRA_KEYS`), each defaulting as in Diffusers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError

#: H.264 CRF Diffusers re-compresses an image-to-video input image with (the compression the model was
#: trained against): 33 with a Gemma-3 text encoder (LTX-2.0 .. 2.3), 18 with Gemma-4 (LTX-2.5); 0 skips it.
DEFAULT_IMAGE_CRF = 33
GEMMA4_IMAGE_CRF = 18


@dataclass(frozen=True)
class LTX2PipelineConfig:
    #: Diffusers' LTX2Pipeline / LTX2ImageToVideoPipeline default to 512x768 (height x width).
    default_height: int = 512
    default_width: int = 768
    #: Diffusers requires sizes divisible by 32 (the released VAE's spatial compression).
    pixel_multiple: int = 32
    #: Gemma tokens are padded to `max_sequence_length` (default 1024); no cap beyond Gemma's positions.
    max_sequence_length_limit: int = 4096
    #: Gemma's padding side (Diffusers sets the tokenizer to it, for chat-style prompts).
    padding_side: str = "left"
    #: The text connectors' feature scale (Diffusers' `scale_factor`).
    text_scale_factor: int = 8


def ltx2_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' LTX2Pipeline.__call__ (121 frames at 24 fps when the folder has no duration head)."""
    return SamplingParams(
        num_inference_steps=30,
        guidance_scale=3.0,
        max_sequence_length=1024,
        num_frames=121,
        fps=24,
        video_format="mp4",
    )


@dataclass(frozen=True)
class LTX2Guidance:
    """One request's LTX-2 settings beyond SamplingParams (Diffusers' `__call__` arguments and defaults).

    The audio scales left at 0 / None take the video's value, as Diffusers' `audio_x = audio_x or x`."""

    audio_guidance_scale: float | None = 7.0
    stg_scale: float = 1.0
    audio_stg_scale: float | None = 1.0
    modality_scale: float = 3.0
    audio_modality_scale: float | None = 3.0
    guidance_rescale: float = 0.7
    audio_guidance_rescale: float | None = 0.7
    #: DiT blocks whose self-attention STG perturbs (Diffusers' default, for LTX-2.3's 48 blocks).
    spatio_temporal_guidance_blocks: tuple[int, ...] = (28,)
    #: Modulate the audio<->video attention by the other modality's sigma (LTX-2.3+; False: LTX-2.0's way).
    use_cross_timestep: bool = True
    #: Positional embeddings use fps / motion_speed: below 1 slows the motion down.
    motion_speed: float = 1.0
    #: The video VAE's decode timestep and the noise mixed in before decoding (timestep-conditioned VAEs;
    #: None: the decode timestep).
    decode_timestep: float = 0.0
    decode_noise_scale: float | None = None
    #: Image-to-video: the H.264 CRF the input image is re-compressed at (None: the model's default).
    image_crf: int | None = None

    def resolved_audio(self, guidance_scale: float) -> tuple[float, float, float, float]:
        """(audio CFG scale, audio STG scale, audio modality scale, audio rescale) after Diffusers' `or`."""
        return (
            self.audio_guidance_scale or guidance_scale,
            self.audio_stg_scale or self.stg_scale,
            self.audio_modality_scale or self.modality_scale,
            self.audio_guidance_rescale or self.guidance_rescale,
        )


#: The keys an LTX-2 request may set in `SamplingParams.extra`.
LTX2_EXTRA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(LTX2Guidance))

_FLOAT_KEYS = {
    "audio_guidance_scale": (0.0, None),
    "stg_scale": (0.0, None),
    "audio_stg_scale": (0.0, None),
    "modality_scale": (0.0, None),
    "audio_modality_scale": (0.0, None),
    "guidance_rescale": (0.0, 1.0),
    "audio_guidance_rescale": (0.0, 1.0),
    "decode_timestep": (0.0, 1.0),
    "decode_noise_scale": (0.0, 1.0),
}
_OPTIONAL = {"audio_guidance_scale", "audio_stg_scale", "audio_modality_scale", "audio_guidance_rescale"}
_OPTIONAL |= {"decode_noise_scale", "image_crf"}


def _number(key: str, value: Any) -> float:
    low, high = _FLOAT_KEYS[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (high is not None and value > high):
        bound = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise InvalidRequestError(f"extra[{key!r}] must be a number {bound}, got {value!r}", param="extra")
    return float(value)


def ltx2_guidance(params: SamplingParams, image_to_video: bool = False) -> LTX2Guidance:
    """The request's LTX-2 settings: Diffusers' defaults, overridden by `params.extra` (checked; an unknown
    key or a bad value is an InvalidRequestError naming it and what it accepts)."""
    allowed = [k for k in LTX2_EXTRA_KEYS if image_to_video or k != "image_crf"]
    unknown = sorted(set(params.extra) - set(allowed))
    if unknown:
        raise InvalidRequestError(
            f"extra has unknown LTX-2 setting(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}",
            param="extra",
        )
    values: dict[str, Any] = {}
    for key, value in params.extra.items():
        if value is None and key in _OPTIONAL:
            values[key] = None
        elif key in _FLOAT_KEYS:
            values[key] = _number(key, value)
        elif key == "spatio_temporal_guidance_blocks":
            if not isinstance(value, (list, tuple)) or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in value
            ):
                raise InvalidRequestError(
                    f"extra['spatio_temporal_guidance_blocks'] must be a list of DiT block indices >= 0, got {value!r}",
                    param="extra",
                )
            values[key] = tuple(sorted(set(value)))
        elif key == "use_cross_timestep":
            if not isinstance(value, bool):
                raise InvalidRequestError(
                    f"extra['use_cross_timestep'] must be true or false, got {value!r}", param="extra"
                )
            values[key] = value
        elif key == "motion_speed":
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise InvalidRequestError(
                    f"extra['motion_speed'] must be a positive number, got {value!r}", param="extra"
                )
            values[key] = float(value)
        else:  # image_crf
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 51:
                raise InvalidRequestError(
                    f"extra['image_crf'] must be an integer in [0, 51] (0: no re-compression), got {value!r}",
                    param="extra",
                )
            values[key] = value
    return LTX2Guidance(**values)
