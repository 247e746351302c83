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

from dataclasses import dataclass, fields, replace

from diffserve.configs.option import option, settings_from
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
    """One request's LTX-2 settings beyond SamplingParams: Diffusers' `__call__` arguments and defaults, each
    declared once (`option`); a request sets them in `SamplingParams.extra` (`ltx2_guidance` checks them).

    The audio scales left at 0 / None take the video's value, as Diffusers' `audio_x = audio_x or x`."""

    audio_guidance_scale: float | None = option(7.0, min=0, help="audio CFG scale (unset: guidance_scale)")
    stg_scale: float = option(1.0, min=0, help="spatio-temporal guidance scale")
    audio_stg_scale: float | None = option(1.0, min=0, help="audio STG scale (unset: stg_scale)")
    modality_scale: float = option(3.0, min=0, help="audio-video modality guidance scale")
    audio_modality_scale: float | None = option(
        3.0, min=0, help="audio modality scale (unset: modality_scale)"
    )
    guidance_rescale: float = option(0.7, min=0, max=1, help="CFG rescale of the video prediction")
    audio_guidance_rescale: float | None = option(
        0.7, min=0, max=1, help="audio CFG rescale (unset: the video's)"
    )
    spatio_temporal_guidance_blocks: tuple[int, ...] | None = option(
        (28,),
        min=0,
        help="DiT blocks whose self-attention STG perturbs (Diffusers' default, for LTX-2.3's 48); null or [] "
        "only with STG off (stg_scale and audio_stg_scale 0)",
    )
    use_cross_timestep: bool = option(
        True, help="modulate audio<->video attention by the other modality's sigma (False: LTX-2.0's way)"
    )
    motion_speed: float = option(
        1.0, gt=0, help="positional embeddings use fps / motion_speed (< 1 slows motion)"
    )
    decode_timestep: float = option(0.0, min=0, max=1, help="the video VAE's decode timestep")
    decode_noise_scale: float | None = option(
        None, min=0, max=1, help="noise mixed in before decoding (unset: the decode timestep)"
    )
    image_crf: int | None = option(
        None, min=0, max=51, help="image-to-video: H.264 CRF the input image is re-compressed at (0: none)"
    )

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


def ltx2_guidance(params: SamplingParams, image_to_video: bool = False) -> LTX2Guidance:
    """The request's LTX-2 settings: Diffusers' defaults, overridden by `params.extra` (checked against the
    declarations; an unknown key or a bad value is an InvalidRequestError naming it and what it accepts).
    `image_crf` applies to image-to-video only. The STG blocks come back sorted, distinct and never None
    (null is no block, as Diffusers takes it); STG on (either STG scale above 0 after Diffusers' `audio_x or
    x`) with no block is refused, as Diffusers' `check_inputs` refuses it."""
    allowed = [k for k in LTX2_EXTRA_KEYS if image_to_video or k != "image_crf"]
    settings = settings_from(LTX2Guidance, params.extra, "extra", allowed)
    blocks = tuple(sorted(set(settings.spatio_temporal_guidance_blocks or ())))
    audio_stg = settings.audio_stg_scale or settings.stg_scale
    if not blocks and (settings.stg_scale > 0 or audio_stg > 0):
        raise InvalidRequestError(
            "extra['spatio_temporal_guidance_blocks'] is empty while spatio-temporal guidance is on "
            f"(stg_scale {settings.stg_scale:g}, audio_stg_scale {audio_stg:g}): list the DiT "
            "blocks STG perturbs (Diffusers' default: [28]), or set stg_scale and audio_stg_scale to 0",
            param="extra",
        )
    return replace(settings, spatio_temporal_guidance_blocks=blocks)
