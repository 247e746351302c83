"""HunyuanVideo image-to-video's fixed facts and the defaults of Diffusers' `HunyuanVideoImageToVideoPipeline`."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import SamplingParams
from diffserve.families.hunyuan_video.config import HunyuanVideoPipelineConfig

#: Diffusers' image-to-video prompt template (its `DEFAULT_PROMPT_TEMPLATE`): the Llava chat turns that wrap a
#: prompt, with the `<image>` placeholder the image's vision tokens replace.
IMAGE_PROMPT_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\n<image>\nDescribe the video by detailing the following "
    "aspects according to the reference image: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>\n\n"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)

#: Diffusers' default `image_embed_interleave` per `image_condition_type`: every k-th image token is kept.
IMAGE_EMBED_INTERLEAVE = {"latent_concat": 2, "token_replace": 4}


@dataclass(frozen=True)
class HunyuanVideoImageToVideoPipelineConfig(HunyuanVideoPipelineConfig):
    """HunyuanVideo's constants with the image-to-video template's crop and image-token positions."""

    prompt_template: str = IMAGE_PROMPT_TEMPLATE
    #: Leading tokens of the template (before the prompt) cut from the text states and mask.
    crop_start: int = 103
    #: The `<image>` token's position in the tokenized template, and how many vision tokens replace it
    #: (the Llava tower's 24 x 24 patches): its states are the image tokens the DiT reads.
    image_emb_start: int = 5
    image_emb_len: int = 576
    #: The assistant turn's header (its last 4 tokens before the answer) is cut from the text too.
    assistant_header_tokens: int = 4
    #: The Llama-3 marker after which each turn's text starts; its last occurrence opens the assistant turn.
    end_header_token: str = "<|end_header_id|>"
    #: `image_embed_interleave` of the negative prompt under true CFG: Diffusers encodes it with its
    #: `encode_prompt` default (2), whatever the DiT's condition type.
    negative_image_embed_interleave: int = 2
    #: The initial latents: noise * keep + image latents * (1 - keep), in float32.
    noise_keep: float = 0.999
    #: "latent_concat" decodes the image's latent frame too; Diffusers drops this many leading frames.
    latent_concat_dropped_frames: int = 4

    @property
    def image_emb_end(self) -> int:
        return self.image_emb_start + self.image_emb_len


@dataclass(frozen=True)
class HunyuanVideoImageToVideoSettings:
    """A request's image-to-video setting beyond SamplingParams (Diffusers' `__call__` argument of that name),
    set in `SamplingParams.extra` and checked by `hunyuan_video_i2v_settings`."""

    image_embed_interleave: int | None = option(
        None,
        min=0,
        help="keep every k-th of the prompt's 576 image tokens (1 to 5; 0 or 6 and more keep them all, as in "
        "Diffusers); unset: the DiT's default (token_replace 4, latent_concat 2). The negative prompt's "
        "black image keeps every 2nd whatever this is, as Diffusers encodes it",
    )

    def interleave(self, condition_default: int) -> int:
        """The prompt's interleave: the request's, else the DiT's `condition_default`."""
        return condition_default if self.image_embed_interleave is None else self.image_embed_interleave


def hunyuan_video_i2v_settings(params: SamplingParams) -> HunyuanVideoImageToVideoSettings:
    """The request's settings: Diffusers' defaults overridden by `params.extra` (an unknown key or a bad value
    is an InvalidRequestError naming it)."""
    return settings_from(HunyuanVideoImageToVideoSettings, params.extra, "extra")


def hunyuan_video_i2v_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' `HunyuanVideoImageToVideoPipeline.__call__`: 50 steps, embedded guidance 1
    (the guidance-distilled DiT reads it), true CFG off (scale 1), 129 frames, 256 Llama tokens."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=1.0,
        true_cfg_scale=1.0,
        max_sequence_length=HunyuanVideoImageToVideoPipelineConfig.default_max_sequence_length,
        num_frames=129,
        fps=HunyuanVideoImageToVideoPipelineConfig.fps,
        video_format="mp4",
    )
