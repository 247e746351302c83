"""Mochi 1 (Diffusers `MochiPipeline`): T5 text with its padding mask, the asymmetric joint DiT
(`models/dits/mochi.py`) on Mochi's VAE latents, flow-matching Euler steps over Mochi's linear-quadratic
sigmas, classic CFG.

Every request's prompt and negative-prompt branches go through one DiT forward; requests at different steps
share it (each row has its own timestep and text mask). As in Diffusers: the timesteps reach the DiT in the
model's dtype, the prediction and CFG (`uncond + scale * (cond - uncond)` when guidance_scale > 1) are
float32, the Euler step runs in float32 and the latents stay in the model's dtype between steps.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.cache_settings import EasyCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.mochi.conditioning import MochiConditioning
from diffserve.families.mochi.config import MochiPipelineConfig, mochi_default_sampling_params
from diffserve.families.mochi.folder_checks import check_vae_layout
from diffserve.families.mochi.stages import (
    MochiDecodingStage,
    MochiInputValidationStage,
    MochiLatentPreparationStage,
    MochiTextEncodingStage,
    MochiTimestepPreparationStage,
)
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu
from diffserve.models.dits.mochi import MochiTransformer3DModel
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, branch_texts, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, VideoRule


def branch_masks(req: Req) -> list[torch.Tensor]:
    """The request's text masks per branch, in `branch_texts` order."""
    conditioning = MochiConditioning.of(req)
    return (
        [conditioning.text_mask, conditioning.negative_text_mask] if req.do_cfg else [conditioning.text_mask]
    )


class MochiDenoiser:
    """One step over a list of Mochi requests of one latent shape, each at its own timestep."""

    def __init__(self, transformer: MochiTransformer3DModel, scheduler, dtype: torch.dtype) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        inputs, texts, masks, timesteps = [], [], [], []
        for req in reqs:
            t = req.schedule.timesteps[req.step_index]
            for text, mask in zip(branch_texts(req), branch_masks(req), strict=True):
                inputs.append(req.latents)
                texts.append(text)
                masks.append(mask)
                timesteps.append(t.expand(req.batch_size))
        prediction = self.transformer(
            hidden_states=torch.cat(inputs).to(self.dtype),
            encoder_hidden_states=torch.cat(texts).to(self.dtype),
            timestep=torch.cat(timesteps).to(self.dtype),
            encoder_attention_mask=torch.cat(masks),
            step_cache=step_cache_for(reqs),  # rows: each request's branches in turn, as it expects
        ).float()
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))
        for req in reqs:
            req.latents = req.latents.to(self.dtype)


class MochiPipeline(Pipeline):
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = MochiPipelineConfig()
    pipeline_name = "MochiPipeline"
    conditioning_type = MochiConditioning
    #: Measured on the tiny random-weight test model (`build_tiny_mochi`, 20 steps, 32x32, 7 frames, CFG 4.5,
    #: the four built-in prompts of `diffserve calibrate-cache`, 1 dB margin, every preset also holding its
    #: bar at 4 and 8 steps): medium EasyCache at 0.5, 26 DiT blocks of 40 at 39.3 dB (13 of 20 steps in
    #: full), as `calibrate-cache` chose it; low EasyCache at 2.4 from the first step, 14 at 33.5 dB (7
    #: steps); draft the step cache at 1.2, 12 at 31.7 dB (6 steps; 30.6 and 30.2 dB at 8 and 4 steps),
    #: `calibrate-cache`'s pick for low and draft alike. Presets reusing more (5 steps in full: 29.4 dB) fall
    #: under 25 dB at 8 steps. Real checkpoints move differently: calibrate them (`diffserve
    #: calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": EasyCacheSettings(reuse_threshold=0.5),
        "low": EasyCacheSettings(reuse_threshold=2.4, start_percent=0.0),
        "draft": StepCachePolicy(threshold=1.2, max_reuse_in_a_row=5),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        dit = transformer.config
        check_vae_layout(vae)
        refuse_dynamic_shifting_without_mu(scheduler, "MochiPipeline")
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = self.spatial * dit.patch_size
        size = (self.config.default_height, self.config.default_width)
        self.input_validation = MochiInputValidationStage(
            defaults=apply_overrides(mochi_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_height,
            max_sequence_length_limit=max(dit.max_sequence_length, self.config.default_max_sequence_length),
            cfg_mode="classic",
            image_inputs=ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video"),
            default_size=lambda _params: size,
            unsupported_params={
                "true_cfg_scale": "Mochi runs classic CFG, set by guidance_scale (> 1 turns it on)",
            },
            video=VideoRule(temporal_factor=self.temporal),
        )
        self.denoiser = MochiDenoiser(transformer, scheduler, context.dtype)
        zeros_for_empty = bool(context.pipeline_options.get("force_zeros_for_empty_prompt", False))
        return [
            self.input_validation,
            MochiTextEncodingStage(
                context.get("tokenizer"), context.get("text_encoder"), context.dtype, zeros_for_empty
            ),
            MochiLatentPreparationStage(
                channels=dit.in_channels,
                spatial=self.spatial,
                temporal=self.temporal,
                device=context.platform.device(),
                dtype=context.dtype,
            ),
            MochiTimestepPreparationStage(scheduler, self.config.threshold_noise),
            DenoisingStage(self.denoiser),
            MochiDecodingStage(vae),
        ]
