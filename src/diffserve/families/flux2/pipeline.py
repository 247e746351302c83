"""FLUX.2 (Diffusers `Flux2Pipeline`, FLUX.2-dev) and FLUX.2 [klein] (`Flux2KleinPipeline`): text to image,
optionally from reference images (multi-reference editing), and the batched denoising step.

dev embeds its guidance scale in the DiT (one branch per output); klein runs real CFG against the empty
prompt (or `negative_prompt`), both branches in ONE DiT forward where Diffusers runs two; a step-distilled
klein runs without CFG. Reference-image tokens follow each row's noisy tokens and only the noisy tokens'
prediction is kept. The text is always padded to `max_sequence_length`, so requests with equal lengths,
grids and reference grids share a step.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from PIL import Image

from diffserve.configs.cache_settings import EasyCacheSettings, TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import InvalidRequestError
from diffserve.families.flux2.conditioning import Flux2Conditioning
from diffserve.families.flux2.config import (
    Flux2KleinPipelineConfig,
    Flux2PipelineConfig,
    flux2_default_sampling_params,
    flux2_klein_default_sampling_params,
    flux2_klein_distilled_sampling_params,
)
from diffserve.families.flux2.folder_checks import check_flux2_folder
from diffserve.families.flux2.latent_preparation import (
    Flux2DecodingStage,
    Flux2LatentPreparationStage,
    Flux2TimestepPreparationStage,
)
from diffserve.families.flux2.reference_images import (
    Flux2ImageInputRule,
    Flux2ReferenceImageStage,
    reference_default_size,
    reference_ids,
)
from diffserve.families.flux2.text_encoding import Flux2KleinTextEncodingStage, Flux2TextEncodingStage
from diffserve.layers.rotary import RopeTables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.flux2 import Flux2Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import (
    advance_requests,
    branch_texts,
    embedded_context,
    split_guided,
    step_cache_for,
)
from diffserve.request import Req
from diffserve.runtime.contract import CfgMode
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import InputValidationStage
from diffserve.stages.previews import predicted_clean_latents


class Flux2Denoiser:
    """One denoising step over FLUX.2 requests (same text length, noisy grid and reference grids), each
    at its own timestep, as one DiT batch: per request its positive row(s), then its negative row(s)
    under CFG."""

    def __init__(
        self,
        transformer: Flux2Transformer2DModel,
        scheduler: FlowMatchEulerScheduler,
        reference_time_offset: int,
        embeds_guidance: bool,
    ) -> None:
        """`embeds_guidance`: whether the pipeline gives the DiT the guidance scale (dev with a
        `guidance_embeds` DiT); otherwise a DiT's guidance embedder is left out, as Diffusers does."""
        self.transformer = transformer
        self.scheduler = scheduler
        self.reference_time_offset = reference_time_offset
        self.embeds_guidance = embeds_guidance
        #: RoPE tables per request shape (least recently used evicted): a few shapes cover a workload.
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache()

    def rope_for(self, req: Req) -> RopeTables:
        """RoPE tables over [text; noisy tokens; reference tokens], once per shape: the ids are a function
        of the text length, the noisy grid and the reference grids."""
        conditioning = Flux2Conditioning.of(req)
        text_ids, image_ids = conditioning.text_ids, conditioning.image_ids
        assert text_ids is not None and image_ids is not None
        device = image_ids.device
        shapes = conditioning.condition_shapes
        key = (text_ids.shape[0], req.latent_size, tuple(shapes))

        def build() -> RopeTables:
            ids = torch.cat([image_ids, *reference_ids(shapes, self.reference_time_offset, device)])
            return self.transformer.rope_tables(text_ids, ids)

        return self._rope_cache.get_or_build(key, device, build)

    def context_for(self, req: Req) -> torch.Tensor:
        """The request's text branches through the DiT's context embedder, once per request (the
        (L x 3 * hidden) @ (3 * hidden x inner) matmul is the same at every step)."""
        return embedded_context(self.transformer, req)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        tokens, timesteps, guidance = [], [], []
        for req in reqs:
            rows = req.latents
            references = Flux2Conditioning.of(req).condition_latents
            if references is not None:
                rows = torch.cat([rows, references.to(rows.dtype)], dim=1)
            t = req.schedule.timesteps[req.step_index].expand(req.batch_size)
            for _ in branch_texts(req):
                tokens.append(rows)
                timesteps.append(t)
                if req.schedule.guidance is not None:
                    guidance.append(req.schedule.guidance)
        first = reqs[0]
        # Timesteps and guidance are already on the latents' device (timestep preparation put them there).
        prediction = self.transformer(
            torch.cat(tokens),
            torch.cat(timesteps).to(first.latents.dtype) / 1000,
            torch.cat(guidance) if guidance else None,
            self.rope_for(first),
            context=torch.cat([self.context_for(r) for r in reqs]),
            step_cache=step_cache_for(reqs),
            skip_guidance_embedder=not self.embeds_guidance,
        )
        prediction = prediction[:, : first.latents.shape[1]]
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))


class Flux2DistilledInputValidationStage(InputValidationStage):
    """A step-distilled FLUX.2 klein folder's validation: it runs without CFG, so a request's guidance_scale
    of at most 1 (no CFG in Diffusers' pipeline either, and the model card's 1.0) is accepted and changes
    nothing; above 1 it is refused, where Diffusers ignores it with a warning."""

    def resolve(self, params: SamplingParams) -> SamplingParams:
        scale = params.guidance_scale
        if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 1:
            raise InvalidRequestError(
                f"guidance_scale={scale:g} does nothing on {self.image_inputs.pipeline_name}: this FLUX.2 klein "
                "checkpoint is step-distilled (model_index.json is_distilled) and runs without CFG; leave "
                "guidance_scale unset or at most 1",
                param="guidance_scale",
            )
        return super().resolve(params)


class Flux2Pipeline(Pipeline):
    """FLUX.2-dev: Mistral Small 3.1 prompt encoding, embedded guidance (`guidance_scale`), optional
    reference images."""

    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config: ClassVar[Flux2PipelineConfig] = Flux2PipelineConfig()
    pipeline_name: ClassVar[str] = "Flux2Pipeline"
    conditioning_type = Flux2Conditioning
    #: Measured on the tiny random-weight test model (`build_tiny_flux2`, dev, 20 steps, 32x32, guidance
    #: 4, the four built-in prompts of `diffserve calibrate-cache --also-steps 8`, 1 dB margin): medium
    #: EasyCache at 0.8, 54 DiT blocks of 60 at 47.2 dB (18 of 20 steps in full; `calibrate-cache` chose
    #: MagCache at 0.25 with ratios measured on the random weights, 51 blocks at 38.3 dB: ratios of random
    #: weights say nothing about a trained DiT, so the next fewest without them is kept); low TeaCache at
    #: 0.6, 45 at 34.4 dB (15 steps; 32.2 dB at 8 steps); draft the step cache at 1.0, 36 at 30.1 dB (12
    #: steps; 32.2 dB at 8 steps), both as `calibrate-cache` chose them. The step cache at 0.45 or below
    #: reuses nothing here, at 1.6 it falls to 21-25 dB. Real checkpoints move differently: calibrate them
    #: (`diffserve calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": EasyCacheSettings(reuse_threshold=0.8),
        "low": TeaCacheSettings(rel_l1_thresh=0.6),
        "draft": StepCachePolicy(threshold=1.0, max_reuse_in_a_row=5),
    }

    def cfg_mode(self, context: PipelineContext) -> CfgMode:
        return "none"

    def sampling_defaults(self, context: PipelineContext) -> SamplingParams:
        return flux2_default_sampling_params()

    def unsupported_params(self, context: PipelineContext) -> dict[str, str]:
        why = "FLUX.2-dev is guidance-distilled: its guidance_scale is embedded in the DiT, no negative branch runs"
        return {"true_cfg_scale": why, "negative_prompt": why}

    def embeds_guidance(self, transformer: Flux2Transformer2DModel) -> bool:
        """Whether the DiT gets the guidance scale (dev's DiT embeds it)."""
        return bool(transformer.config.guidance_embeds)

    def validation_cls(self, context: PipelineContext) -> type[InputValidationStage]:
        """The input validation stage's class (a step-distilled klein folder checks its guidance_scale)."""
        return InputValidationStage

    def text_stage(self, context: PipelineContext) -> Flux2TextEncodingStage:
        return Flux2TextEncodingStage(
            context.get("tokenizer"),
            context.get("text_encoder"),
            self.config.text_encoder_out_layers,
            self.config.system_message,
            context.dtype,
        )

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        device, dtype = context.platform.device(), context.dtype
        cfg = self.config
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * cfg.latent_patch_size
        default_pixels = cfg.default_sample_size * self.vae_scale_factor
        multiple, area = self.pixel_multiple, cfg.reference_max_area
        self.input_validation = self.validation_cls(context)(
            defaults=apply_overrides(self.sampling_defaults(context), context.folder_sampling_defaults),
            pixel_multiple=multiple,
            default_pixels=default_pixels,
            max_sequence_length_limit=cfg.max_sequence_length_limit,
            cfg_mode=self.cfg_mode(context),
            image_inputs=Flux2ImageInputRule(
                pipeline_name=self.pipeline_name,
                max_images=cfg.max_input_images,
                min_side=cfg.reference_min_side,
                max_aspect_ratio=cfg.reference_max_aspect_ratio,
            ),
            unsupported_params=self.unsupported_params(context),
            default_size=lambda params: reference_default_size(params, multiple, area, default_pixels),
        )
        text_stage = self.text_stage(context)
        check_flux2_folder(transformer, vae, text_stage.state_width)
        guidance_embeds = self.embeds_guidance(transformer)
        self.denoiser = Flux2Denoiser(transformer, scheduler, cfg.reference_time_offset, guidance_embeds)
        self.decoder = Flux2DecodingStage(vae)
        return [
            self.input_validation,
            text_stage,
            Flux2ReferenceImageStage(vae, multiple, area, device=device, dtype=dtype),
            Flux2LatentPreparationStage(transformer.config.in_channels, self.vae_scale_factor, device, dtype),
            Flux2TimestepPreparationStage(scheduler, guidance_embeds=guidance_embeds),
            DenoisingStage(self.denoiser),
            self.decoder,
        ]

    def preview_images(self, req: Req) -> list[Image.Image]:
        """The predicted clean latents of the last step, decoded at full size (FLUX.2's `bn`-normalised
        latents do not fit the generic `DecodeLayout` previews)."""
        return self.decoder.decode(predicted_clean_latents(req).to(req.latents.dtype), req)


class Flux2KleinPipeline(Flux2Pipeline):
    """FLUX.2 [klein]: Qwen3 prompt encoding, CFG against the empty prompt with `guidance_scale` > 1
    (none for a step-distilled checkpoint), optional reference images."""

    config: ClassVar[Flux2PipelineConfig] = Flux2KleinPipelineConfig()
    pipeline_name: ClassVar[str] = "Flux2KleinPipeline"
    #: Picked by hand on the tiny random-weight test model (`build_tiny_flux2` klein, 20 steps, 32x32, CFG 4,
    #: four prompts: the quality-tier test's two and two short ones), where reusing a single step can drop
    #: a prompt to 26.6 dB: medium the step cache at 0.2, which reuses nothing there (20 of
    #: 20 steps in full, as `calibrate-cache` chose it); low the step cache at 0.5, 38.6 dB on the one
    #: prompt it reuses a step on, the exact output on the others (19-20 steps); draft TeaCache at 0.6,
    #: 28.1-36.0 dB (16-18 steps). `calibrate-cache`'s low and draft (EasyCache at 0.5 and 0.8, 33.4 and
    #: 28.6 dB mean) fall to 28.9 and 21.9 dB on one of its prompts. Real checkpoints move differently:
    #: calibrate them (`diffserve calibrate-cache`). Step-distilled folders serve "high" only.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": StepCachePolicy(threshold=0.2, max_reuse_in_a_row=3),
        "low": StepCachePolicy(threshold=0.5, max_reuse_in_a_row=3),
        "draft": TeaCacheSettings(rel_l1_thresh=0.6),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        """FLUX.2's stages; a step-distilled checkpoint serves "high" only (see `step_cache_policies`)."""
        if self.is_distilled(context):
            # It samples in about 4 steps: with the first two and the last always computed, a tier would
            # reuse at most one step, and no tier was measured at that count.
            self.step_cache_policies = {}
        return super().build_stages(context)

    @staticmethod
    def is_distilled(context: PipelineContext) -> bool:
        """model_index.json's `is_distilled` (Diffusers' pipeline config; absent means False)."""
        return bool(context.pipeline_options.get("is_distilled", False))

    def cfg_mode(self, context: PipelineContext) -> CfgMode:
        return "none" if self.is_distilled(context) else "classic"

    def sampling_defaults(self, context: PipelineContext) -> SamplingParams:
        if self.is_distilled(context):
            return flux2_klein_distilled_sampling_params()
        return flux2_klein_default_sampling_params()

    def unsupported_params(self, context: PipelineContext) -> dict[str, str]:
        unsupported = {"true_cfg_scale": "FLUX.2 klein's CFG scale is guidance_scale (> 1 turns CFG on)"}
        if self.is_distilled(context):
            # guidance_scale <= 1 is accepted (Flux2DistilledInputValidationStage), as Diffusers takes it.
            why = "this FLUX.2 klein checkpoint is step-distilled (model_index.json is_distilled) and runs without CFG"
            unsupported.update(negative_prompt=why)
        return unsupported

    def validation_cls(self, context: PipelineContext) -> type[InputValidationStage]:
        if self.is_distilled(context):
            return Flux2DistilledInputValidationStage
        return InputValidationStage

    def embeds_guidance(self, transformer: Flux2Transformer2DModel) -> bool:
        """Never: Diffusers' klein pipeline passes no guidance to its DiT (its CFG is real)."""
        return False

    def text_stage(self, context: PipelineContext) -> Flux2TextEncodingStage:
        return Flux2KleinTextEncodingStage(
            context.get("tokenizer"),
            context.get("text_encoder"),
            self.config.text_encoder_out_layers,
            self.config.system_message,
            context.dtype,
        )
