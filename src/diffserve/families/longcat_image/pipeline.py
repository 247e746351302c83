"""LongCat-Image (Diffusers `LongCatImagePipeline`) and LongCat-Image-Edit (`LongCatImageEditPipeline`):
stages and the batched denoising step.

The DiT is FLUX.1's with its own timestep embedding (`models/dits/longcat_image.py`); the text is
Qwen2.5-VL's, always `tokenizer_max_length` tokens, so requests with any prompts share a batch when their
latent grids agree. CFG is Diffusers' two-branch guidance (both branches in one forward here), followed by
LongCat-Image's per-token renormalisation (`renormalised_cfg`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch

from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.longcat_image.conditioning import (
    LongCatImageConditioning,
    LongCatImageEditConditioning,
)
from diffserve.families.longcat_image.config import (
    LongCatImageEditPipelineConfig,
    LongCatImagePipelineConfig,
    edit_default_size,
    longcat_image_default_sampling_params,
    longcat_image_edit_default_sampling_params,
    longcat_image_settings,
)
from diffserve.families.longcat_image.edit_stages import (
    LongCatEditLatentPreparationStage,
    LongCatEditPreparationStage,
    LongCatEditTextEncodingStage,
)
from diffserve.families.longcat_image.folder_checks import check_longcat_image_folder
from diffserve.families.longcat_image.stages import LongCatLatentPreparationStage, LongCatTextEncodingStage
from diffserve.layers.rotary import RopeTables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import (
    BranchBatch,
    advance_requests,
    branch_texts,
    embedded_context,
    gather_branches,
    split_guided,
    step_cache_for,
)
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import (
    FamilySettingsValidationStage,
    ImageInputRule,
    InputValidationStage,
)
from diffserve.stages.reference_images import ReferenceImages
from diffserve.stages.timestep_preparation import TimestepPreparationStage


def renormalised_cfg(
    positive: torch.Tensor, negative: torch.Tensor, scale: float, *, renorm: bool, renorm_min: float
) -> torch.Tensor:
    """Classic CFG, then (with `renorm`) each token's guided vector scaled down to at most the prompt
    branch's norm: by norm(positive) / norm(guided), clamped to [renorm_min, 1]."""
    guided = negative + scale * (positive - negative)
    if not renorm:
        return guided
    ratio = torch.linalg.vector_norm(positive, dim=-1, keepdim=True) / (
        torch.linalg.vector_norm(guided, dim=-1, keepdim=True) + 1e-8
    )
    return guided * ratio.clamp(min=renorm_min, max=1.0)


class LongCatImageDenoiser:
    """One denoising step over a list of LongCat-Image requests, each at its own timestep, in one DiT batch
    (a request with CFG contributes both branches). Requests in one call share the latent grid."""

    def __init__(
        self, transformer: LongCatImageTransformer2DModel, scheduler: FlowMatchEulerScheduler
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        #: RoPE tables per latent grid (least recently used evicted).
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache()

    def rope_for(self, req: Req) -> RopeTables:
        """The request's RoPE tables, once per shape: its ids depend on the text length and the latent grid
        (an edit's input image has the output's grid)."""
        ids = LongCatImageConditioning.of(req)
        text_ids, image_ids = ids.text_ids, ids.image_ids
        assert text_ids is not None and image_ids is not None
        key = (text_ids.shape[0], image_ids.shape[0], req.latent_size)
        return self._rope_cache.get_or_build(
            key, image_ids.device, lambda: self.transformer.rope_tables(text_ids, image_ids)
        )

    def context_for(self, req: Req) -> torch.Tensor:
        """The request's text branches through the DiT's context embedder, once per request."""
        return embedded_context(self.transformer, req)

    def image_tokens(self, batch: BranchBatch, reqs: list[Req]) -> torch.Tensor:
        """The DiT's image tokens, one row per branch: the noisy latents (an edit appends its input image's
        tokens; only the noisy tokens' prediction is kept)."""
        return torch.cat(batch.latents)

    def guided(self, prediction: torch.Tensor, reqs: list[Req]) -> list[torch.Tensor]:
        """Each request's prediction, with its CFG renormalisation settings."""
        return guided_predictions(prediction, reqs)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        first = reqs[0]
        ids = LongCatImageConditioning.of(first)
        prediction = self.transformer(
            hidden_states=self.image_tokens(batch, reqs),
            encoder_hidden_states=None,
            context=torch.cat([self.context_for(r) for r in reqs]),
            timestep=torch.cat(batch.timesteps).to(first.latents.dtype) / 1000,
            img_ids=ids.image_ids,
            txt_ids=ids.text_ids,
            rope=self.rope_for(first),
            step_cache=step_cache_for(reqs),
        )
        prediction = prediction[:, : first.latents.shape[1]]
        advance_requests(self.scheduler, reqs, self.guided(prediction, reqs))


def guided_predictions(prediction: torch.Tensor, reqs: list[Req]) -> list[torch.Tensor]:
    """Each request's prediction from its rows of `prediction`, guided with its own renorm settings."""
    out, offset = [], 0
    for req in reqs:
        rows = req.batch_size * (2 if req.do_cfg else 1)
        settings = longcat_image_settings(req.params)
        combine = partial(
            renormalised_cfg, renorm=settings.enable_cfg_renorm, renorm_min=settings.cfg_renorm_min
        )
        out.extend(split_guided(prediction[offset : offset + rows], [req], combine=combine))
        offset += rows
    return out


class LongCatImagePipeline(Pipeline):
    """LongCat-Image text-to-image. The folder's `text_processor` serves only Diffusers' prompt rewriting
    (refused here, `config.py`): it is accepted and loaded, and no stage reads it."""

    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    optional_components = ("text_processor",)
    config = LongCatImagePipelineConfig()
    conditioning_type: ClassVar[type[LongCatImageConditioning]] = LongCatImageConditioning
    #: FLUX.1's presets (the same blocks). On the tiny random-weight model (`build_tiny_longcat_image`, 20
    #: steps, 64x64, CFG 4.5) they keep the bars: medium 52.6 dB (19 of 20 steps in full), low 39.3 dB (12),
    #: draft 35.2 dB (6). Calibrate a real checkpoint (`diffserve calibrate-cache`) before trusting them; a
    #: folder's own calibration file wins.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": StepCachePolicy(threshold=0.2, max_reuse_in_a_row=3),
        "low": StepCachePolicy(threshold=0.45, max_reuse_in_a_row=5),
        "draft": StepCachePolicy(threshold=1.6, max_reuse_in_a_row=5),
    }

    #: How the refusals of request fields name the model.
    display_name = "LongCat-Image"
    denoiser_cls: ClassVar[type[LongCatImageDenoiser]] = LongCatImageDenoiser
    latent_stage_cls: ClassVar[type[LongCatLatentPreparationStage]] = LongCatLatentPreparationStage
    #: The initial noise's dtype (Diffusers draws the text-to-image noise in float32); None: the model's.
    noise_dtype: ClassVar[torch.dtype | None] = torch.float32

    def validation_for(self, context: PipelineContext) -> InputValidationStage:
        """Text-to-image only, with the family's settings in `extra`."""
        return self.validation(
            context,
            longcat_image_default_sampling_params(),
            ImageInputRule(pipeline_name="LongCatImagePipeline"),
            FamilySettingsValidationStage,
            # enable_cfg_renorm, cfg_renorm_min; raises on unknown keys, bad values, enable_prompt_rewrite
            settings=longcat_image_settings,
        )

    def validation(
        self,
        context: PipelineContext,
        defaults: SamplingParams,
        image_inputs: ImageInputRule,
        stage_cls: type[InputValidationStage] = InputValidationStage,
        **options: Any,
    ) -> InputValidationStage:
        """The input validation both pipelines share: classic CFG (guidance_scale, not true_cfg_scale), and
        the whole `tokenizer_max_length` encoded whatever max_sequence_length a request asks for."""
        config = self.config
        return stage_cls(
            defaults=apply_overrides(defaults, context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=config.default_sample_size * self.vae_scale_factor,
            max_sequence_length_limit=config.tokenizer_max_length,
            cfg_mode="classic",
            image_inputs=image_inputs,
            unsupported_params={
                "true_cfg_scale": f"{self.display_name}'s CFG is set by guidance_scale (> 1 turns it on)",
                "max_sequence_length": (
                    f"{self.display_name} always encodes {config.tokenizer_max_length} prompt tokens (padded)"
                ),
            },
            **options,
        )

    def text_stage_kwargs(self, context: PipelineContext) -> dict[str, Any]:
        """The text encoding stage's arguments (the edit pipeline's stage takes more)."""
        config = self.config
        return {
            "tokenizer": context.get("tokenizer"),
            "text_encoder": context.get("text_encoder"),
            "prefix": config.prompt_prefix,
            "suffix": config.prompt_suffix,
            "max_length": config.tokenizer_max_length,
            "output_dtype": context.dtype,
        }

    def encoding_stages(self, context: PipelineContext) -> list[Stage]:
        """The stages between input validation and latent preparation: the prompt's."""
        return [LongCatTextEncodingStage(**self.text_stage_kwargs(context))]

    def latent_preparation_stage(self, context: PipelineContext) -> Stage:
        return self.latent_stage_cls(
            latent_channels=self.config.latent_channels,
            vae_scale_factor=self.vae_scale_factor,
            device=context.platform.device(),
            dtype=context.dtype,
            noise_dtype=self.noise_dtype or context.dtype,
        )

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        text_width = context.get("text_encoder").config.get_text_config().hidden_size
        check_longcat_image_folder(transformer, vae.config, self.config.latent_channels, text_width)
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * self.config.latent_patch_size
        self.input_validation = self.validation_for(context)
        return [
            self.input_validation,
            *self.encoding_stages(context),
            self.latent_preparation_stage(context),
            TimestepPreparationStage(scheduler, guidance_embeds=False),
            DenoisingStage(self.denoiser_cls(transformer, scheduler)),
            DecodingStage(vae),
        ]


class LongCatImageEditDenoiser(LongCatImageDenoiser):
    """Each row reads [noisy tokens; the input image's tokens]; CFG without renormalisation (Diffusers' edit
    pipeline has none)."""

    def image_tokens(self, batch: BranchBatch, reqs: list[Req]) -> torch.Tensor:
        rows = []
        for req in reqs:
            condition = ReferenceImages.of(req).condition_latents
            rows.extend(torch.cat([req.latents, condition], dim=1) for _ in branch_texts(req))
        return torch.cat(rows)

    def guided(self, prediction: torch.Tensor, reqs: list[Req]) -> list[torch.Tensor]:
        return split_guided(prediction, reqs)


class LongCatImageEditPipeline(LongCatImagePipeline):
    """LongCat-Image-Edit: one input image and an instruction. The output size is the input's aspect ratio at
    about one megapixel (`edit_output_size`); a request's height and width replace that size (Diffusers has
    no such parameters: its output equals diffserve's when its rule gives the same size)."""

    required_components = ("text_encoder", "tokenizer", "text_processor", "vae", "transformer", "scheduler")
    optional_components = ()
    config = LongCatImageEditPipelineConfig()
    conditioning_type: ClassVar[type[LongCatImageConditioning]] = LongCatImageEditConditioning

    display_name = "LongCat-Image-Edit"
    denoiser_cls: ClassVar[type[LongCatImageDenoiser]] = LongCatImageEditDenoiser
    latent_stage_cls: ClassVar[type[LongCatLatentPreparationStage]] = LongCatEditLatentPreparationStage
    noise_dtype: ClassVar[torch.dtype | None] = None

    def validation_for(self, context: PipelineContext) -> InputValidationStage:
        """One input image; the output size follows its aspect ratio (`edit_output_size`) when unset."""
        area, multiple, pixels = self.config.output_area, self.config.size_multiple, self.pixel_multiple
        return self.validation(
            context,
            longcat_image_edit_default_sampling_params(),
            ImageInputRule(
                pipeline_name="LongCatImageEditPipeline", task="image-edit", min_images=1, max_images=1
            ),
            default_size=lambda params: edit_default_size(params, area, multiple, pixels),
        )

    def encoding_stages(self, context: PipelineContext) -> list[Stage]:
        """The input image's latents, then the instruction with the image (its vision tower's input)."""
        return [
            LongCatEditPreparationStage(
                context.get("vae"), device=context.platform.device(), dtype=context.dtype
            ),
            LongCatEditTextEncodingStage(
                **self.text_stage_kwargs(context),
                image_processor=context.get("text_processor").image_processor,
            ),
        ]
