"""HunyuanVideo image-to-video (Diffusers `HunyuanVideoImageToVideoPipeline`): text-to-video's stages with
the input image in the Llava text encoding (its vision tokens lead the text states) and in the latents
(`image_to_video.py`), by the DiT's `image_condition_type`: "token_replace" (the released HunyuanVideo-I2V,
guidance-distilled) or "latent_concat" (HunyuanVideo-I2V-33ch).

As Diffusers: the output has the requested size (720x1280 by default, whatever the image's aspect ratio;
the image is resized to it), embedded guidance 1 by default, true CFG with a negative prompt when
`true_cfg_scale > 1` (the negative read with a black image). "latent_concat" outputs 4 frames fewer than
`num_frames` (Diffusers drops them); unlike Diffusers, several outputs per prompt are served (each the
video Diffusers makes from that output's noise). Diffusers' `image_embed_interleave` is the request's
`extra["image_embed_interleave"]`.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from diffserve.configs.cache_settings import EasyCacheSettings, TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.hunyuan_video.conditioning import HunyuanVideoImageConditioning
from diffserve.families.hunyuan_video.image_text_encoding import HunyuanVideoImageTextEncodingStage
from diffserve.families.hunyuan_video.image_to_video import (
    HunyuanVideoImageLatentsStage,
    HunyuanVideoImageToVideoDenoiser,
)
from diffserve.families.hunyuan_video.image_to_video_config import (
    IMAGE_EMBED_INTERLEAVE,
    HunyuanVideoImageToVideoPipelineConfig,
    hunyuan_video_i2v_default_sampling_params,
    hunyuan_video_i2v_settings,
)
from diffserve.families.hunyuan_video.pipeline import HunyuanVideoDenoiser, HunyuanVideoPipeline
from diffserve.families.hunyuan_video.stages import HunyuanVideoDecodingStage
from diffserve.pipelines.base import PipelineContext
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage


class HunyuanVideoImageInputValidationStage(InputValidationStage):
    """Input validation that refuses a "latent_concat" clip of one frame (Diffusers drops 4 decoded frames,
    leaving none) and checks the request's `extra` settings (`image_embed_interleave`)."""

    takes_family_settings = True

    def __init__(self, min_frames: int, **kwargs) -> None:
        super().__init__(**kwargs)
        #: The fewest `num_frames` that leave a frame after the dropped ones.
        self.min_frames = min_frames

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        hunyuan_video_i2v_settings(resolved)  # raises on unknown keys or bad values
        return resolved

    def forward(self, req: Req) -> Req:
        req = super().forward(req)
        if req.params.num_frames < self.min_frames:
            raise InvalidRequestError(
                f"HunyuanVideoImageToVideoPipeline with a latent_concat DiT drops the first 4 decoded frames: "
                f"num_frames must be at least {self.min_frames}, got {req.params.num_frames}",
                param="num_frames",
            )
        return req


class HunyuanVideoImageToVideoPipeline(HunyuanVideoPipeline):
    required_components = (*HunyuanVideoPipeline.required_components, "image_processor")
    config = HunyuanVideoImageToVideoPipelineConfig()
    pipeline_name = "HunyuanVideoImageToVideoPipeline"
    conditioning_type = HunyuanVideoImageConditioning
    image_to_video = True
    #: Chosen by `diffserve calibrate-cache` on the tiny random-weight I2V test model
    #: (`build_tiny_hunyuan_video_i2v`, token_replace, 20 steps, 32x32, 5 frames, a 32x32 gradient input
    #: image, embedded guidance 1 and no true CFG as the family's defaults, the four built-in prompts, 1 dB
    #: margin, every candidate also holding the bar at 4 and 8 steps): medium EasyCache at 0.8, 34.5 DiT
    #: blocks of 40 at 42.0 dB (17.2 of 20 steps in full), low TeaCache at 0.8, 22 at 32.4 dB (11 steps),
    #: draft TeaCache at 4.8, 7.5 at 27.7 dB (3.8 steps). The text-to-video presets fall under the low and
    #: draft bars here (25.4 and 21.0 dB). Real checkpoints move differently: calibrate them.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": EasyCacheSettings(reuse_threshold=0.8),
        "low": TeaCacheSettings(rel_l1_thresh=0.8),
        "draft": TeaCacheSettings(rel_l1_thresh=4.8),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        condition = context.get("transformer").config.image_condition_type
        if condition is None:
            raise ValueError(
                "HunyuanVideoImageToVideoPipeline needs an image-to-video DiT: transformer/config.json sets "
                "no image_condition_type (a text-to-video DiT; serve it as HunyuanVideoPipeline)"
            )
        self.token_replace = condition == "token_replace"
        self.image_embed_interleave = IMAGE_EMBED_INTERLEAVE[condition]
        self.dropped_frames = 0 if self.token_replace else self.config.latent_concat_dropped_frames
        return super().build_stages(context)

    def make_input_validation(self, **kwargs) -> InputValidationStage:
        return HunyuanVideoImageInputValidationStage(min_frames=self.dropped_frames + 1, **kwargs)

    def default_params(self) -> SamplingParams:
        return hunyuan_video_i2v_default_sampling_params()

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(
            pipeline_name=self.pipeline_name, task="image-to-video", min_images=1, max_images=1
        )

    def text_token_limit(self, text_encoder: nn.Module) -> int:
        """The Llama positions left after the crop and the image tokens the `<image>` token becomes."""
        positions = int(text_encoder.config.text_config.max_position_embeddings)
        return positions - self.config.crop_start - (self.config.image_emb_len - 1)

    def text_encoding_stage(self, context: PipelineContext) -> Stage:
        return HunyuanVideoImageTextEncodingStage(
            context.get("tokenizer"),
            context.get("text_encoder"),
            context.get("tokenizer_2"),
            context.get("text_encoder_2"),
            context.get("image_processor"),
            self.config,
            output_dtype=context.dtype,
            image_embed_interleave=self.image_embed_interleave,
        )

    def latent_stages(self, context: PipelineContext) -> list[Stage]:
        """Float32 noise of the latent channels ("latent_concat": (in_channels - 1) / 2), then the image's."""
        in_channels = context.get("transformer").config.in_channels
        channels = in_channels if self.token_replace else (in_channels - 1) // 2
        return [
            self.noise_stage(context, channels),
            HunyuanVideoImageLatentsStage(context.get("vae"), self.token_replace, self.config.noise_keep),
        ]

    def video_decoding_stage(self, vae: nn.Module) -> Stage:
        return HunyuanVideoDecodingStage(vae, dropped_frames=self.dropped_frames)

    def make_denoiser(self, context: PipelineContext) -> HunyuanVideoDenoiser:
        return HunyuanVideoImageToVideoDenoiser(
            context.get("transformer"),
            context.get("scheduler"),
            context.dtype,
            self.config.guidance_multiplier,
            token_replace=self.token_replace,
        )
