"""HunyuanVideo 1.5 (Diffusers `HunyuanVideo15Pipeline`, `HunyuanVideo15ImageToVideoPipeline`): stages and the
batched denoising step.

Guidance follows the folder's `ClassifierFreeGuidance` guider (`models/guiders/`): its formula, rescale and
default scale, with the request's `guidance_scale` over the default; the two branches of every request
share one DiT forward, with the request's own negative prompt (empty by default, as Diffusers encodes
None). The DiT reads the noisy latents with the condition latents and mask on channels (zeros for
text-to-video, the input image's first frame for image-to-video), Qwen2.5-VL and ByT5 text states with
their masks, and for image-to-video the image's SigLIP states. MeanFlow-distilled image-to-video DiTs
(`use_meanflow`) also read the next step's timestep, as Diffusers' image-to-video pipeline passes it.

Unlike Diffusers' text-to-video pipeline, which fails on several videos per prompt (its zero image states
have one row per prompt), several outputs per prompt are served: each is the video Diffusers makes from that
output's rows of the noise. Height and width are given together or not at all (Diffusers refuses one alone).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from PIL import Image

from diffserve.configs.cache_settings import EasyCacheSettings, TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import InvalidRequestError
from diffserve.families.hunyuan_video15.conditioning import (
    HunyuanVideo15Conditioning,
    HunyuanVideo15EmptyConditionStage,
    HunyuanVideo15ImageConditionStage,
    HunyuanVideo15LatentPreparationStage,
)
from diffserve.families.hunyuan_video15.config import (
    HunyuanVideo15PipelineConfig,
    hunyuan_video15_default_sampling_params,
)
from diffserve.families.hunyuan_video15.decoding import HunyuanVideo15DecodingStage
from diffserve.families.hunyuan_video15.folder_checks import check_hunyuan_video15_folder
from diffserve.families.hunyuan_video15.sizes import closest_bucket, size_buckets
from diffserve.families.hunyuan_video15.text_encoding import HunyuanVideo15TextEncodingStage
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.loader.folder_fit import encoder_hidden_size, refuse_dynamic_shifting_without_mu
from diffserve.models.dits.hunyuan_video15 import HunyuanVideo15Transformer3DModel
from diffserve.models.guiders.classifier_free_guidance import ClassifierFreeGuidance
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, split_guided, step_cache_for
from diffserve.pipelines.glyph_text_batch import GLYPH_TEXT_COMPONENTS, GlyphTextBatch
from diffserve.request import Req
from diffserve.runtime.runner import CfgBranchView
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage, VideoRule
from diffserve.stages.timestep_preparation import set_schedule


class HunyuanVideo15InputValidationStage(InputValidationStage):
    """Input validation whose CFG decision is the guider's: the negative branch runs unless the guider is
    disabled or the scale is its neutral one (1, or 0 with the paper's formula), at any other scale."""

    def __init__(self, guider: ClassifierFreeGuidance, **kwargs) -> None:
        super().__init__(**kwargs)
        self.guider = guider

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Also refuses a request that sets one of height and width: the size is a bucket of the aspect
        ratio (16:9, or the input image's) unless both sides are given, and Diffusers' text-to-video
        pipeline refuses one side alone too (`check_inputs`)."""
        if (params.height is None) != (params.width is None):
            given, missing = ("height", "width") if params.width is None else ("width", "height")
            raise InvalidRequestError(
                f"{self.image_inputs.pipeline_name} takes height and width together: {given} is set, "
                f"{missing} is not (leave both out for the default size bucket)",
                param=missing,
            )
        return super().resolve(params)

    def forward(self, req: Req) -> Req:
        req = super().forward(req)
        p = req.params
        req.cfg_scale = float(p.guidance_scale)
        req.do_cfg = self.guider.runs_cfg(req.cfg_scale)
        if req.do_cfg and p.negative_prompt is None:
            p.negative_prompt = ""  # what Diffusers encodes for a missing negative prompt
        return req


class HunyuanVideo15TimestepPreparationStage(Stage):
    """Sigmas linspace(1, 0, steps + 1) without the final 0, shifted by the scheduler's `shift`."""

    needs = ("latents",)
    sets = ("schedule",)

    def __init__(self, scheduler) -> None:
        refuse_dynamic_shifting_without_mu(scheduler, "HunyuanVideo 1.5's pipelines")
        self.scheduler = scheduler

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        base = np.linspace(1.0, 0.0, steps + 1)[:-1]
        set_schedule(req, self.scheduler.schedule(steps, sigmas=base))
        return req


class HunyuanVideo15Denoiser:
    """One step over a list of requests of one latent shape, each at its own timestep."""

    def __init__(
        self,
        transformer: HunyuanVideo15Transformer3DModel,
        scheduler,
        guider: ClassifierFreeGuidance,
        meanflow: bool,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.guider = guider
        self.meanflow = meanflow
        self.dtype = next(transformer.parameters()).dtype

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch, images = GlyphTextBatch(self.meanflow, self.dtype), []
        for req in reqs:
            conditioning = HunyuanVideo15Conditioning.of(req)
            model_input = torch.cat([req.latents, conditioning.condition_latents], dim=1).to(self.dtype)
            for branch in conditioning.text_branches(req):
                batch.add(req, model_input, branch)
                if conditioning.image_embeds is not None:
                    images.append(conditioning.image_embeds)
        if images and len(images) != len(batch.latents):
            raise ValueError("a HunyuanVideo 1.5 batch mixes requests with and without an input image")
        prediction = self.transformer(
            **batch.dit_kwargs(),
            image_embeds=torch.cat(images) if images else None,
            step_cache=step_cache_for(reqs),  # rows: each request's branches in turn, as it expects
        )
        guided = split_guided(prediction, reqs, self.guider.guide)
        for i, req in enumerate(reqs):
            if not req.do_cfg and not isinstance(req, CfgBranchView):
                guided[i] = self.guider.rescaled(guided[i], guided[i])  # as Diffusers without CFG
        advance_requests(self.scheduler, reqs, guided)


class HunyuanVideo15Pipeline(Pipeline):
    #: cache-dit runs its DBCache with the CFG branch apart for this pipeline (`enable_separate_cfg`).
    cache_separate_cfg = True
    required_components = (*GLYPH_TEXT_COMPONENTS, "guider")
    config = HunyuanVideo15PipelineConfig()
    pipeline_name = "HunyuanVideo15Pipeline"
    conditioning_type = HunyuanVideo15Conditioning
    #: Measured on the tiny random-weight T2V test model (`build_tiny_hunyuan_video15`, 2 blocks, 20 steps,
    #: 32x32, 5 frames, the family's default guidance, the four built-in prompts of `diffserve
    #: calibrate-cache`, 1 dB margin, every preset also holding its bar at 4 and 8 steps): the original step
    #: cache at 0.6 (2 reuses in a row), EasyCache at 1.2 and TeaCache at 6.4, 28, 24 and 6 DiT blocks of 40
    #: at 37.2, 33.4 and 26.9 dB (14, 12 and 3 of 20 steps in full; at 8 steps 37.6, 38.1 and 31.7 dB); the
    #: image-to-video pipeline inherits them (tests/e2e/test_quality_tiers_video15_ltx2.py holds both). Real
    #: checkpoints move differently: calibrate them (`diffserve calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": StepCachePolicy(threshold=0.6, full_first_steps=2, full_last_steps=1, max_reuse_in_a_row=2),
        "low": EasyCacheSettings(reuse_threshold=1.2),
        "draft": TeaCacheSettings(rel_l1_thresh=6.4),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        guider: ClassifierFreeGuidance = context.get("guider")
        check_hunyuan_video15_folder(
            transformer.config,
            vae.config,
            encoder_hidden_size(context.get("text_encoder")),
            int(context.get("text_encoder_2").config.d_model),
            self.image_state_width(context),
        )
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = self.spatial * transformer.config.patch_size
        self.buckets = size_buckets(
            transformer.config.target_size, self.spatial, self.config.max_bucket_aspect_ratio
        )
        self.denoiser = HunyuanVideo15Denoiser(
            transformer, scheduler, guider, self.uses_meanflow(transformer)
        )
        defaults = apply_overrides(
            hunyuan_video15_default_sampling_params(), {"guidance_scale": guider.guidance_scale}
        )
        self.input_validation = HunyuanVideo15InputValidationStage(
            guider,
            defaults=apply_overrides(defaults, context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.buckets[0][0],
            max_sequence_length_limit=None,
            cfg_mode="classic",
            image_inputs=self.image_input_rule(),
            default_size=self.default_size,
            unsupported_params={
                "true_cfg_scale": "it runs classifier-free guidance set by guidance_scale (the folder's "
                "guider gives the default)",
                "max_sequence_length": f"its text is {self.config.text_tokens} Qwen2.5-VL tokens and "
                f"{self.config.glyph_tokens} ByT5 bytes, fixed as in Diffusers",
            },
            video=VideoRule(temporal_factor=self.temporal),
        )
        return [
            self.input_validation,
            HunyuanVideo15TextEncodingStage(
                context.get("tokenizer"),
                context.get("text_encoder"),
                context.get("tokenizer_2"),
                context.get("text_encoder_2"),
                self.config,
                output_dtype=context.dtype,
                device=context.platform.device(),
            ),
            HunyuanVideo15LatentPreparationStage(
                channels=int(vae.config["latent_channels"]),
                spatial=self.spatial,
                temporal=self.temporal,
                device=context.platform.device(),
                dtype=self.denoiser.dtype,
            ),
            self.condition_stage(context),
            HunyuanVideo15TimestepPreparationStage(scheduler),
            DenoisingStage(self.denoiser),
            HunyuanVideo15DecodingStage(vae),
        ]

    def uses_meanflow(self, transformer: HunyuanVideo15Transformer3DModel) -> bool:
        """Diffusers' text-to-video pipeline never passes MeanFlow's second timestep."""
        return False

    def image_state_width(self, context: PipelineContext) -> int | None:
        """The width of the image states the DiT reads from an image encoder; None: text-to-video reads none
        (its zero image states have the DiT's `image_embed_dim`)."""
        return None

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video")

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        """The bucket of the default aspect ratio (16:9 landscape) at the DiT's target size."""
        width, height = self.config.default_aspect_ratio
        return closest_bucket(height, width, self.buckets)

    def condition_stage(self, context: PipelineContext) -> Stage:
        return HunyuanVideo15EmptyConditionStage()

    def preview_images(self, req: Req) -> list[Image.Image]:
        """The first frame of each output's predicted clean video (the decoding stage's own preview)."""
        stage = self.decoding_stage
        if not isinstance(stage, HunyuanVideo15DecodingStage):
            raise TypeError(
                f"{type(self).__name__} decodes through HunyuanVideo15DecodingStage, not {stage.name}"
            )
        return stage.preview_images(req)


class HunyuanVideo15ImageToVideoPipeline(HunyuanVideo15Pipeline):
    """Animates one input image. Without height/width the output takes the bucket closest to the image's
    aspect ratio (Diffusers' only choice); either way the image is scaled and centre-cropped to it."""

    required_components = (*HunyuanVideo15Pipeline.required_components, "image_encoder", "feature_extractor")
    pipeline_name = "HunyuanVideo15ImageToVideoPipeline"

    def uses_meanflow(self, transformer: HunyuanVideo15Transformer3DModel) -> bool:
        return bool(transformer.config.use_meanflow)

    def image_state_width(self, context: PipelineContext) -> int | None:
        """SigLIP's hidden_size: its last hidden states are the DiT's image tokens."""
        return int(context.get("image_encoder").config.hidden_size)

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, min_images=1, max_images=1)

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        if not params.input_images:
            raise InvalidRequestError(f"{self.pipeline_name} needs an input image", param="image")
        image = params.input_images[0]
        return closest_bucket(image.height, image.width, self.buckets)

    def condition_stage(self, context: PipelineContext) -> Stage:
        return HunyuanVideo15ImageConditionStage(
            context.get("feature_extractor"),
            context.get("image_encoder"),
            context.get("vae"),
            output_dtype=context.dtype,
        )
