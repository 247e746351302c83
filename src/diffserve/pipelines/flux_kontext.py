"""FLUX.1 Kontext (Diffusers `FluxKontextPipeline`): FLUX.1 image editing from one input image.

The input image is VAE-encoded once per request and its packed latents are appended to every row's
noisy image tokens, with their own position ids (first axis 1); the DiT is FLUX.1's, unchanged. Only the
prediction for the noisy tokens is kept. As in FLUX.1, guidance is the DiT's embedded guidance (3.5 by
default) and true CFG runs only with `true_cfg_scale > 1` and a negative prompt.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.flux import FluxKontextPipelineConfig, flux_default_sampling_params
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.pipelines.base import PipelineContext
from diffserve.pipelines.cfg_batch import BranchBatch
from diffserve.pipelines.flux import FluxDenoiser, FluxPipeline
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.flux_kontext_preparation import (
    FluxKontextPreparationStage,
    kontext_area_size,
    kontext_condition_ids,
)
from diffserve.stages.flux_text_encoding import FluxTextEncodingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage
from diffserve.stages.latent_preparation import LatentPreparationStage
from diffserve.stages.text_encoding import clip_context_length
from diffserve.stages.timestep_preparation import TimestepPreparationStage


class FluxKontextDenoiser(FluxDenoiser):
    """One denoising step over Kontext requests that share the noisy grid and the input image's grid."""

    def rope_for(self, req: Req):
        """RoPE tables over [text; noisy tokens; input-image tokens], computed once per shape."""
        (_, rows, cols) = req.condition_shapes[0]
        key = (
            req.text_ids.shape[0],
            req.latent_height,
            req.latent_width,
            rows,
            cols,
            req.image_ids.device,
            req.image_ids.dtype,
        )
        tables = self._rope_cache.get(key)
        if tables is None:
            ids = torch.cat(
                [req.image_ids, kontext_condition_ids(rows, cols, req.image_ids.device, req.image_ids.dtype)]
            )
            tables = self.transformer.rope_tables(req.text_ids, ids)
            self._rope_cache[key] = tables
            if len(self._rope_cache) > self.max_cached_rope_shapes:
                self._rope_cache.popitem(last=False)
        else:
            self._rope_cache.move_to_end(key)
        return tables

    def image_tokens(self, batch: BranchBatch, reqs: list[Req]) -> torch.Tensor:
        """Each branch's noisy tokens followed by its request's input-image tokens."""
        conditions = [r.condition_latents for r in reqs for _ in range(2 if r.do_cfg else 1)]
        return torch.cat([torch.cat([x, c], dim=1) for x, c in zip(batch.latents, conditions, strict=True)])


class FluxKontextPipeline(FluxPipeline):
    """Edits one input image (required); see `FluxKontextPipelineConfig` for the output size."""

    config = FluxKontextPipelineConfig()
    #: Exact path only until the step cache is calibrated on a Kontext checkpoint (the input-image
    #: tokens change what the cache's signal measures).
    step_cache_policies: ClassVar[dict[str, StepCachePolicy]] = {}

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        clip_tokenizer = context.get("tokenizer")
        device, dtype = context.platform.device(), context.dtype
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * self.config.latent_patch_size
        default_pixels = self.config.default_sample_size * self.vae_scale_factor
        default_size = kontext_area_size(
            default_pixels, default_pixels, self.config.max_area, self.pixel_multiple
        )
        self.input_validation = InputValidationStage(
            defaults=apply_overrides(flux_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=default_pixels,
            max_sequence_length_limit=self.config.max_t5_sequence_length,
            image_inputs=ImageInputRule(
                pipeline_name="FluxKontextPipeline", task="image-edit", min_images=1, max_images=1
            ),
            default_size=lambda params: default_size,
        )
        self.denoiser = FluxKontextDenoiser(transformer, scheduler)
        return [
            self.input_validation,
            FluxTextEncodingStage(
                clip_tokenizer,
                context.get("text_encoder"),
                context.get("tokenizer_2"),
                context.get("text_encoder_2"),
                clip_max_length=clip_context_length(clip_tokenizer, self.config.clip_max_length),
                output_dtype=dtype,
            ),
            FluxKontextPreparationStage(
                vae,
                self.pixel_multiple,
                self.config.preferred_resolutions,
                self.config.auto_resize,
                device=device,
                dtype=dtype,
            ),
            LatentPreparationStage(
                latent_channels=transformer.config.in_channels // 4,
                vae_scale_factor=self.vae_scale_factor,
                device=device,
                dtype=dtype,
            ),
            TimestepPreparationStage(scheduler, transformer.config.guidance_embeds),
            DenoisingStage(self.denoiser),
            DecodingStage(vae),
        ]

    def batch_key(self, req: Req) -> tuple:
        """The base key plus both token grids: transposed grids have equal token counts but other ids."""
        return (
            *super().batch_key(req),
            (req.latent_height, req.latent_width),
            tuple(req.condition_shapes),
        )
