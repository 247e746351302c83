"""HunyuanVideo 1.0 (Diffusers `HunyuanVideoPipeline`): Llama states (templated, cropped, masked) and CLIP's
pooled text, the double/single-stream DiT (`models/dits/hunyuan_video.py`) on HunyuanVideo's VAE latents,
flow-matching Euler steps over shifted linear sigmas.

Guidance, as in Diffusers: the guidance-distilled DiT embeds `guidance_scale` (times 1000, in the DiT's
dtype) at every step; true CFG runs only with `true_cfg_scale > 1` and a negative prompt, its branch
sharing the request's DiT forward (`negative + scale * (positive - negative)`, in the DiT's dtype).

Dtypes, as in Diffusers: the noise is drawn in float32; the DiT reads the latents in its dtype and the
timesteps in the latents' dtype; the Euler step runs in float32 and leaves the latents in the
prediction's dtype (float32 at the start, the DiT's after the first step).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from diffserve.configs.cache_settings import TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.families.hunyuan_video.conditioning import HunyuanVideoConditioning
from diffserve.families.hunyuan_video.config import (
    HunyuanVideoPipelineConfig,
    hunyuan_video_default_sampling_params,
)
from diffserve.families.hunyuan_video.folder_checks import check_hunyuan_video_folder
from diffserve.families.hunyuan_video.stages import (
    HunyuanVideoDecodingStage,
    HunyuanVideoTimestepPreparationStage,
)
from diffserve.families.hunyuan_video.text_encoding import HunyuanVideoTextEncodingStage
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.loader.folder_fit import encoder_hidden_size
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage, VideoRule
from diffserve.stages.latent_preparation import VideoLatentPreparationStage


def branch_inputs(req: Req) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(Llama states, mask, pooled CLIP text) per branch in row order: the prompt's, then the negative's."""
    c = HunyuanVideoConditioning.of(req)
    branches = [(req.prompt_embeds, c.text_mask, req.pooled_prompt_embeds)]
    if req.do_cfg:
        branches.append((req.negative_prompt_embeds, c.negative_text_mask, req.negative_pooled_prompt_embeds))
    return branches


def pad_texts(
    states: list[torch.Tensor], masks: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Text states (rows, L_i, dim) and masks (rows, L_i) padded on the right to the longest L_i, with zeros
    and False (image-to-video's negative prompt carries more image tokens than its prompt). The DiT masks
    keys past each row's valid count, so the padding is never attended; equal lengths pass unchanged."""
    longest = max(s.shape[1] for s in states)

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra = longest - x.shape[1]
        return x if extra == 0 else torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)

    return [pad(s) for s in states], [pad(m) for m in masks]


class HunyuanVideoDenoiser:
    """One step over a list of HunyuanVideo requests of one latent shape, each at its own timestep."""

    def __init__(
        self,
        transformer: HunyuanVideoTransformer3DModel,
        scheduler,
        dtype: torch.dtype,
        guidance_multiplier: float,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.dtype = dtype
        self.guidance_multiplier = guidance_multiplier

    def model_input(self, req: Req) -> torch.Tensor:
        """The DiT's latent input of a request (in the latents' dtype; the step casts it)."""
        return req.latents

    def advance(self, reqs: list[Req], predictions: list[torch.Tensor]) -> None:
        """One Euler step of each request along its own sigmas."""
        advance_requests(self.scheduler, reqs, predictions)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        latents, timesteps, texts, masks, pooled, guidance = [], [], [], [], [], []
        for req in reqs:
            t = req.schedule.timesteps[req.step_index].to(req.latents.dtype).expand(req.batch_size)
            model_input = self.model_input(req).to(self.dtype)
            for states, mask, pool in branch_inputs(req):
                latents.append(model_input)
                timesteps.append(t)
                texts.append(states)
                masks.append(mask)
                pooled.append(pool)
                if req.schedule.guidance is not None:
                    guidance.append(req.schedule.guidance.to(self.dtype) * self.guidance_multiplier)
        texts, masks = pad_texts(texts, masks)
        prediction = self.transformer(
            hidden_states=torch.cat(latents),
            timestep=torch.cat(timesteps),
            encoder_hidden_states=torch.cat(texts),
            encoder_attention_mask=torch.cat(masks),
            pooled_projections=torch.cat(pooled),
            guidance=torch.cat(guidance) if guidance else None,
            step_cache=step_cache_for(reqs),  # rows: each request's branches in turn, as it expects
        )
        self.advance(reqs, split_guided(prediction, reqs))


class HunyuanVideoPipeline(Pipeline):
    required_components = (
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
        "vae",
        "transformer",
        "scheduler",
    )
    config = HunyuanVideoPipelineConfig()
    pipeline_name = "HunyuanVideoPipeline"
    conditioning_type = HunyuanVideoConditioning
    #: Whether the pipeline reads an input image (which DiT channels it feeds: `folder_checks.py`).
    image_to_video: ClassVar[bool] = False
    #: Measured on the tiny random-weight T2V test model (`build_tiny_hunyuan_video`, 20 steps, 32x32, 5
    #: frames, embedded guidance 6 and no true CFG as the family's defaults, the four built-in prompts of
    #: `diffserve calibrate-cache`, 1 dB margin, every preset also holding its bar at 4 and 8 steps): TeaCache
    #: (the raw change) at 0.6, 1.0 and 6.4, 25.5, 21.5 and 6 DiT blocks of 40 at 37.5, 35.8 and 29.0 dB
    #: (12.8, 10.8 and 3 of 20 steps in full; at 8 steps 49.8, 30.7 and 30.1 dB). `calibrate-cache` picks
    #: TeaCache at 0.6 for medium and EasyCache at 1.2 (12 steps) for low and draft alike. Real checkpoints
    #: move differently: calibrate them (`diffserve calibrate-cache`). The image-to-video pipeline has its
    #: own.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": TeaCacheSettings(rel_l1_thresh=0.6),
        "low": TeaCacheSettings(rel_l1_thresh=1.0),
        "draft": TeaCacheSettings(rel_l1_thresh=6.4),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        check_hunyuan_video_folder(
            transformer.config,
            vae.config,
            encoder_hidden_size(context.get("text_encoder")),
            int(context.get("text_encoder_2").config.hidden_size),
            self.image_to_video,
        )
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = self.spatial * transformer.config.patch_size
        size = (self.config.default_height, self.config.default_width)
        self.input_validation = self.make_input_validation(
            defaults=apply_overrides(self.default_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_height,
            max_sequence_length_limit=self.text_token_limit(context.get("text_encoder")),
            cfg_mode="true_cfg",
            image_inputs=self.image_input_rule(),
            default_size=lambda _params: size,
            video=VideoRule(temporal_factor=self.temporal),
        )
        self.denoiser = self.make_denoiser(context)
        return [
            self.input_validation,
            self.text_encoding_stage(context),
            *self.latent_stages(context),
            HunyuanVideoTimestepPreparationStage(scheduler, transformer.config.guidance_embeds),
            DenoisingStage(self.denoiser),
            self.video_decoding_stage(vae),
        ]

    def make_input_validation(self, **kwargs) -> InputValidationStage:
        """The validation stage from `InputValidationStage`'s keywords."""
        return InputValidationStage(**kwargs)

    def default_params(self) -> SamplingParams:
        return hunyuan_video_default_sampling_params()

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video")

    def text_token_limit(self, text_encoder: nn.Module) -> int:
        """The largest `max_sequence_length`: the Llama positions left after the template's crop."""
        return int(text_encoder.config.max_position_embeddings) - self.config.crop_start

    def text_encoding_stage(self, context: PipelineContext) -> Stage:
        return HunyuanVideoTextEncodingStage(
            context.get("tokenizer"),
            context.get("text_encoder"),
            context.get("tokenizer_2"),
            context.get("text_encoder_2"),
            self.config,
            output_dtype=context.dtype,
        )

    def latent_stages(self, context: PipelineContext) -> list[Stage]:
        """The initial latents: float32 noise of the DiT's channels."""
        return [self.noise_stage(context, context.get("transformer").config.in_channels)]

    def noise_stage(self, context: PipelineContext, channels: int) -> Stage:
        return VideoLatentPreparationStage(
            channels=channels,
            spatial=self.spatial,
            temporal=self.temporal,
            device=context.platform.device(),
        )

    def video_decoding_stage(self, vae: nn.Module) -> Stage:
        return HunyuanVideoDecodingStage(vae)

    def make_denoiser(self, context: PipelineContext) -> HunyuanVideoDenoiser:
        return HunyuanVideoDenoiser(
            context.get("transformer"),
            context.get("scheduler"),
            context.dtype,
            self.config.guidance_multiplier,
        )
