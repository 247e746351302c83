"""Stable Diffusion 3 / 3.5 (Diffusers `StableDiffusion3Pipeline`): stages and the batched denoising step."""

from __future__ import annotations

import torch

from diffserve.configs.sd3 import SD3PipelineConfig, sd3_default_sampling_params
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, gather_branches, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage
from diffserve.stages.latent_preparation import SpatialLatentPreparationStage
from diffserve.stages.sd3_text_encoding import SD3TextEncodingStage
from diffserve.stages.text_encoding import clip_context_length
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage


class SD3Denoiser:
    """One step over a list of SD3 requests; classic CFG's two branches share the forward."""

    def __init__(self, transformer: SD3Transformer2DModel, scheduler: FlowMatchEulerScheduler) -> None:
        self.transformer = transformer
        self.scheduler = scheduler

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        prediction = self.transformer(
            hidden_states=torch.cat(batch.latents),
            encoder_hidden_states=torch.cat(batch.text),
            pooled_projections=torch.cat(batch.pooled),
            timestep=torch.cat(batch.timesteps).to(reqs[0].latents.dtype),  # already on the latents' device
            step_cache=step_cache_for(reqs),
        )
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))


class SD3Pipeline(Pipeline):
    required_components = (
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "vae",
        "transformer",
        "scheduler",
    )
    #: SD3 runs without T5 (its sequence part is then zeros, as in Diffusers), saving ~9 GB on the real model.
    optional_components = ("text_encoder_3", "tokenizer_3")
    config = SD3PipelineConfig()
    #: FLUX's provisional values from before its calibration on the demo model: the tiny test model (20 steps, 64x64) clears every bar by 15+ dB with them (10 / 7 / 5
    #: steps in full for medium / low / draft) and does not tell thresholds apart (2 full steps still give
    #: 46 dB), so they stay as on the closest real family until `diffserve calibrate-cache` replaces them.
    step_cache_policies = {
        "medium": StepCachePolicy(threshold=0.1, max_reuse_in_a_row=2),
        "low": StepCachePolicy(threshold=0.25, max_reuse_in_a_row=3),
        "draft": StepCachePolicy(threshold=0.5, max_reuse_in_a_row=5),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        patch = transformer.config.patch_size
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * patch
        self.input_validation = InputValidationStage(
            defaults=apply_overrides(sd3_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=transformer.config.sample_size * self.vae_scale_factor,
            max_sequence_length_limit=self.config.max_t5_sequence_length,
            image_inputs=ImageInputRule(pipeline_name="StableDiffusion3Pipeline"),
            unsupported_params={
                "true_cfg_scale": "SD3 runs classic CFG, set by guidance_scale (with negative_prompt)",
            },
            cfg_mode="classic",
        )
        clip_tokenizer = context.get("tokenizer")
        clip_max_length = clip_context_length(clip_tokenizer, self.config.clip_max_length)
        return [
            self.input_validation,
            SD3TextEncodingStage(
                (clip_tokenizer, context.get("tokenizer_2")),
                (context.get("text_encoder"), context.get("text_encoder_2")),
                context.get_optional("tokenizer_3"),
                context.get_optional("text_encoder_3"),
                clip_max_length=clip_max_length,
                joint_attention_dim=transformer.config.joint_attention_dim,
                output_dtype=context.dtype,
            ),
            SpatialLatentPreparationStage(
                latent_channels=transformer.config.in_channels,
                vae_scale_factor=self.vae_scale_factor,
                device=context.platform.device(),
                dtype=context.dtype,
            ),
            DefaultTimestepPreparationStage(scheduler, patch_size=patch),
            DenoisingStage(SD3Denoiser(transformer, scheduler)),
            DecodingStage(vae, packed_latents=False),
        ]
