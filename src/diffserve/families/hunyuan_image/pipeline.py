"""HunyuanImage 2.1 (Diffusers `HunyuanImagePipeline`): stages and the batched denoising step.

Guidance follows the folder's guider components (`guider.py`): `ocr_guider` for a prompt with quoted text
when the folder has one, else `guider`; without either (the distilled folders) no guidance runs. The chosen
guider fixes the formula and its APG settings; its `guidance_scale` is the default CFG scale, which a
request's `guidance_scale` replaces. The two branches of every request share one DiT forward, with the
request's own negative prompt (empty by default, as Diffusers encodes None). Guidance-distilled DiTs
(`guidance_embeds`) embed `extra["distilled_guidance_scale"]` (Diffusers' default 3.25) times 1000; MeanFlow
DiTs (`use_meanflow`) also read the next step's timestep (0 after the last), as Diffusers passes them.

Dtypes as in Diffusers: the noise, latents, timesteps and guidance are in the DiT's dtype, and so is the
guided prediction; the Euler step runs in float32.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from diffserve.configs.cache_settings import DBCacheSettings
from diffserve.configs.option import settings_from
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.hunyuan_image.conditioning import HunyuanImageConditioning
from diffserve.families.hunyuan_image.config import (
    HunyuanImagePipelineConfig,
    HunyuanImageSettings,
    hunyuan_image_default_sampling_params,
)
from diffserve.families.hunyuan_image.folder_checks import check_hunyuan_image_folder
from diffserve.families.hunyuan_image.guider import AdaptiveProjectedMixGuidance
from diffserve.families.hunyuan_image.text_encoding import HunyuanImageTextEncodingStage, glyph_text
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu
from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, split_guided, step_cache_for
from diffserve.pipelines.glyph_text_batch import GLYPH_TEXT_COMPONENTS, GlyphTextBatch
from diffserve.request import Req
from diffserve.runtime.runner import CfgBranchView
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage
from diffserve.stages.latent_preparation import SpatialLatentPreparationStage
from diffserve.stages.timestep_preparation import set_schedule


class HunyuanImageInputValidationStage(InputValidationStage):
    """Input validation whose CFG decision is the chosen guider's (`guider_for`): the negative branch runs
    when that guider is enabled and the CFG scale (the request's, else the guider's) is not its neutral one.
    Guidance-distilled DiTs take `extra["distilled_guidance_scale"]`; other folders refuse any `extra`."""

    takes_family_settings = True

    def __init__(
        self,
        guider: AdaptiveProjectedMixGuidance | None,
        ocr_guider: AdaptiveProjectedMixGuidance | None,
        guidance_embeds: bool,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.guider = guider
        self.ocr_guider = ocr_guider
        self.guidance_embeds = guidance_embeds

    def guider_for(self, prompt: str) -> AdaptiveProjectedMixGuidance | None:
        """`ocr_guider` for a prompt whose quoted text the glyph encoder reads (when the folder has one),
        else `guider`; None when the folder has neither or the one chosen is disabled."""
        chosen = (
            self.ocr_guider if glyph_text(prompt) is not None and self.ocr_guider is not None else self.guider
        )
        return chosen if chosen is not None and chosen.enabled else None

    def settings(self, params: SamplingParams) -> HunyuanImageSettings:
        """The request's `extra` settings (refused unless the DiT embeds guidance)."""
        allowed = ["distilled_guidance_scale"] if self.guidance_embeds else []
        return settings_from(HunyuanImageSettings, params.extra, "extra", allowed)

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        self.settings(resolved)  # raises on unknown keys or bad values
        if resolved.guidance_scale is not None and self.guider_for(resolved.prompt) is None:
            raise InvalidRequestError(
                f"guidance_scale is not a parameter of {self.image_inputs.pipeline_name} with this folder: it "
                "has no enabled guider (a guidance-distilled model embeds extra's distilled_guidance_scale)",
                param="guidance_scale",
            )
        return resolved

    def forward(self, req: Req) -> Req:
        req = super().forward(req)
        p = req.params
        guider = self.guider_for(p.prompt)
        conditioning = HunyuanImageConditioning.of(req)
        conditioning.guider = guider
        req.cfg_scale = (
            float(p.guidance_scale if p.guidance_scale is not None else guider.guidance_scale)
            if guider
            else 1.0
        )
        req.do_cfg = guider is not None and guider.runs_cfg(req.cfg_scale)
        if req.do_cfg and p.negative_prompt is None:
            p.negative_prompt = ""  # what Diffusers encodes for a missing negative prompt
        return req


class HunyuanImageTimestepPreparationStage(Stage):
    """Sigmas linspace(1, 0, steps + 1) without the final 0, shifted by the scheduler's `shift`; for a
    guidance-distilled DiT, the embedded guidance (distilled scale times 1000, in the DiT's dtype)."""

    needs = ("latents",)
    sets = ("schedule",)

    def __init__(
        self,
        scheduler,
        settings: HunyuanImageInputValidationStage,
        guidance_embeds: bool,
        multiplier: float,
        dtype: torch.dtype,
    ) -> None:
        refuse_dynamic_shifting_without_mu(scheduler, "HunyuanImage's pipeline")
        self.scheduler = scheduler
        self.settings = settings
        self.guidance_embeds = guidance_embeds
        self.multiplier = multiplier
        self.dtype = dtype

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        base = np.linspace(1.0, 0.0, steps + 1)[:-1]
        guidance = None
        if self.guidance_embeds:
            scale = self.settings.settings(req.params).distilled_guidance_scale
            guidance = torch.full((req.batch_size,), scale, dtype=self.dtype, device=req.latents.device)
            guidance = guidance * self.multiplier
        set_schedule(req, self.scheduler.schedule(steps, sigmas=base), guidance)
        return req


def _both_branches(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """`split_guided`'s combine that keeps both branches, (2, rows, ...): the guider needs the request."""
    return torch.stack([cond, uncond])


class HunyuanImageDenoiser:
    """One step over a list of requests of one latent shape, each at its own timestep and guidance step."""

    def __init__(self, transformer: HunyuanImageTransformer2DModel, scheduler, meanflow: bool) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.meanflow = meanflow
        self.dtype = next(transformer.parameters()).dtype

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch, guidance = GlyphTextBatch(self.meanflow, self.dtype), []
        for req in reqs:
            for branch in HunyuanImageConditioning.of(req).text_branches(req):
                batch.add(req, req.latents.to(self.dtype), branch)
                if req.schedule.guidance is not None:
                    guidance.append(req.schedule.guidance)
        prediction = self.transformer(
            **batch.dit_kwargs(),
            guidance=torch.cat(guidance) if guidance else None,
            step_cache=step_cache_for(reqs),  # rows: each request's branches in turn, as it expects
        )
        branches = split_guided(prediction, reqs, _both_branches)
        guided = [self.guide(req, rows) for req, rows in zip(reqs, branches, strict=True)]
        advance_requests(self.scheduler, reqs, guided)

    def guide(self, req: Req, rows: torch.Tensor) -> torch.Tensor:
        """The request's prediction: its rows as they are without guidance, else its guider's combination of
        its (cond, uncond) pair at its step, the request's momentum advanced."""
        if not (req.do_cfg or isinstance(req, CfgBranchView)):
            return rows
        conditioning = HunyuanImageConditioning.of(req)
        guider = conditioning.guider
        assert guider is not None, "a guided HunyuanImage request carries the guider its prompt chose"
        pred, conditioning.momentum = guider.guide(
            rows[0], rows[1], req.cfg_scale, req.step_index, conditioning.momentum
        )
        return pred


class HunyuanImagePipeline(Pipeline):
    required_components = GLYPH_TEXT_COMPONENTS
    optional_components = ("guider", "ocr_guider")
    config = HunyuanImagePipelineConfig()
    pipeline_name = "HunyuanImagePipeline"
    conditioning_type = HunyuanImageConditioning
    #: Measured on the tiny random-weight test model (`build_tiny_hunyuan_image`, 20 steps, 32x32, its
    #: folder's guiders (APG, CFG 3.5; OCR 5) as the family's default, the four built-in prompts of `diffserve
    #: calibrate-cache`, 1 dB margin): DBCache F1B0 (each CFG branch deciding apart, the family's default)
    #: reusing the last block after a 2-step warm-up, at most 3 steps in all (1 in a row), 8 and 10 (3 in a
    #: row), 37, 32 and 30 DiT blocks of 40 at 44.7, 35.2 and 34.4 dB (17, 12 and 10 of 20 steps in full). The
    #: whole-span methods depend on the prompt here (TeaCache at 1.2: 29.5 dB at 12 steps on those prompts,
    #: 22.6 dB on others); `calibrate-cache`, which also holds every bar at 4 and 8 steps, finds only the step
    #: cache at 0.45 (one step reused, 44.2 dB) for medium and low and EasyCache at 1.2 for draft (13.8 steps,
    #: 27.8 dB). These presets keep their bars at 20 steps only (at 8 steps: 30.8, 21.3 and 21.3 dB). Real
    #: checkpoints move differently: calibrate them (`diffserve calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": DBCacheSettings(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=2,
            max_cached_steps=3, max_continuous_cached_steps=1,
        ),
        "low": DBCacheSettings(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=2,
            max_cached_steps=8, max_continuous_cached_steps=3,
        ),
        "draft": DBCacheSettings(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=2,
            max_cached_steps=10, max_continuous_cached_steps=3,
        ),
    }  # fmt: skip
    #: cache-dit runs its DBCache with the CFG branch apart for this pipeline (`enable_separate_cfg`: the
    #: guider's two branches are forwards of their own in Diffusers' pipeline).
    cache_separate_cfg = True

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer: HunyuanImageTransformer2DModel = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        dit = transformer.config
        check_hunyuan_image_folder(
            dit,
            vae.config["latent_channels"],
            context.get("text_encoder").config.get_text_config().hidden_size,
            context.get("text_encoder_2").config.d_model,
        )
        spatial = int(vae.spatial_compression_ratio)
        self.pixel_multiple = spatial * dit.patch_size[0]
        self.denoiser = HunyuanImageDenoiser(transformer, scheduler, bool(dit.use_meanflow))
        default_side = self.config.default_latent_size * spatial
        self.input_validation = HunyuanImageInputValidationStage(
            context.get_optional("guider"),
            context.get_optional("ocr_guider"),
            bool(dit.guidance_embeds),
            defaults=apply_overrides(
                hunyuan_image_default_sampling_params(), context.folder_sampling_defaults
            ),
            pixel_multiple=self.pixel_multiple,
            default_pixels=default_side,
            max_sequence_length_limit=None,
            cfg_mode="none",
            image_inputs=ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-image"),
            unsupported_params={
                "true_cfg_scale": "its guidance is the folder's guider, whose CFG scale guidance_scale sets",
                "max_sequence_length": f"its text is {self.config.text_tokens} Qwen2.5-VL tokens and "
                f"{self.config.glyph_tokens} ByT5 bytes, fixed as in Diffusers",
            },
        )
        return [
            self.input_validation,
            HunyuanImageTextEncodingStage(
                context.get("tokenizer"),
                context.get("text_encoder"),
                context.get("tokenizer_2"),
                context.get("text_encoder_2"),
                self.config,
                output_dtype=self.denoiser.dtype,
                device=context.platform.device(),
            ),
            SpatialLatentPreparationStage(
                latent_channels=dit.in_channels,
                vae_scale_factor=spatial,
                device=context.platform.device(),
                dtype=self.denoiser.dtype,
            ),
            HunyuanImageTimestepPreparationStage(
                scheduler,
                self.input_validation,
                bool(dit.guidance_embeds),
                self.config.guidance_embedding_multiplier,
                self.denoiser.dtype,
            ),
            DenoisingStage(self.denoiser),
            DecodingStage(vae, packed_latents=False),
        ]
