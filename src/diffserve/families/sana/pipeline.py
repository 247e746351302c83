"""SANA (Diffusers `SanaPipeline`): Gemma-2 text, a linear-attention DiT on DC-AE latents, classic CFG;
and SANA-Sprint (`SanaSprintPipeline`): the same text and VAE, a guidance-embedding consistency DiT sampled
by SCM in one to four steps.

Every request's prompt and negative-prompt branches go through ONE DiT forward (Diffusers concatenates
them too). Each text keeps only its real tokens (`families/sana/text_encoding.py`), so branches and
requests may differ in text length: the denoiser embeds each branch once per request, right-pads the
embedded texts to the longest in the batch and masks the padding, which the DiT's cross-attention then
weighs exactly 0, as Diffusers weighs its own padding. Latents and the scheduler stay float32 whatever
the DiT's dtype, as in Diffusers; sizes are snapped to SANA's aspect-ratio bins and the images resized
back (`families/sana/resolution.py`) unless a request sets `use_resolution_binning` false in `extra`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.sana.config import (
    SanaPipelineConfig,
    SanaSprintPipelineConfig,
    sana_default_sampling_params,
    sana_sprint_default_sampling_params,
)
from diffserve.families.sana.resolution import (
    ASPECT_RATIO_1024_BIN,
    BINS_BY_SAMPLE_SIZE,
    ResolutionBinning,
    SanaDecodingStage,
    SanaLatentPreparationStage,
)
from diffserve.families.sana.sprint import SCMTimestepPreparationStage
from diffserve.families.sana.text_encoding import SanaTextEncodingStage
from diffserve.families.sana.validation import SanaInputValidationStage
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu
from diffserve.models.dits.sana import SanaTransformer2DModel
from diffserve.models.schedulers.dpm_solver_flow import DPMSolverFlowScheduler
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.scm import SCMScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import (
    advance_requests,
    gather_branches,
    pad_text,
    split_guided,
    step_cache_for,
)
from diffserve.pipelines.padded_text_denoiser import PaddedTextDenoiser
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage


class SanaDenoiser(PaddedTextDenoiser):
    """One step over a list of SANA requests (same latent grid), each at its own timestep; the DiT reads
    the scheduler's timesteps times `config.timestep_scale`."""

    transformer: SanaTransformer2DModel

    def __init__(
        self,
        transformer: SanaTransformer2DModel,
        scheduler: DPMSolverFlowScheduler | FlowMatchEulerScheduler | SCMScheduler,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(transformer, scheduler, dtype)
        self.timestep_scale = float(transformer.config.timestep_scale)

    def dit_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps * self.timestep_scale


class SanaSprintDenoiser(SanaDenoiser):
    """One SCM step over a list of SANA-Sprint requests (no CFG: the guidance scale is embedded).

    The DiT is a TrigFlow consistency model: it sees the sample scaled to unit variance and normalised
    for the angle's mix of signal and noise, and its timestep is the angle t mapped to
    sin(t) / (sin(t) + cos(t)); its output is turned back into TrigFlow's prediction (all as Diffusers).
    """

    def __init__(
        self, transformer: SanaTransformer2DModel, scheduler: SCMScheduler, dtype: torch.dtype
    ) -> None:
        super().__init__(transformer, scheduler, dtype)
        self.sigma_data = float(scheduler.config["sigma_data"])

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        context, mask = pad_text([branch for req in reqs for branch in self.context_for(req)])
        angle = torch.cat(batch.timesteps)
        scm = torch.sin(angle) / (torch.cos(angle) + torch.sin(angle))
        scm_map = scm.view(-1, 1, 1, 1)
        model_input = torch.cat(batch.latents) / self.sigma_data * torch.sqrt(scm_map**2 + (1 - scm_map) ** 2)
        output = self.transformer(
            hidden_states=model_input.to(self.dtype),
            encoder_hidden_states=None,
            encoder_attention_mask=mask,
            timestep=scm,
            guidance=torch.cat([req.schedule.guidance for req in reqs]),
            context=context,
            step_cache=step_cache_for(reqs),
        )
        prediction = (
            (1 - 2 * scm_map) * model_input + (1 - 2 * scm_map + 2 * scm_map**2) * output
        ) / torch.sqrt(scm_map**2 + (1 - scm_map) ** 2)
        prediction = prediction.float() * self.sigma_data
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))


class SanaPipeline(Pipeline):
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = SanaPipelineConfig()
    #: Picked by hand (FLUX.1's step-cache ladder, draft reusing up to 8 steps in a row) and checked
    #: on the tiny random-weight test model (`build_tiny_sana`, 20 steps, 32x32, CFG 4.5, two prompts):
    #: medium 50.9-51.6 dB (7 of 20 steps in full), low 47.8 dB (5 steps), draft 45.3-45.7 dB (4 steps); at
    #: 8 steps 55.4-55.6, 46.7-53.8 and 46.2-46.7 dB. Its output barely moves between steps, so
    #: `calibrate-cache` there would pick presets far bolder than a trained checkpoint takes: calibrate a
    #: real one (`diffserve calibrate-cache`). SANA-Sprint serves "high" only (`SanaSprintPipeline`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": StepCachePolicy(threshold=0.2, max_reuse_in_a_row=3),
        "low": StepCachePolicy(threshold=0.45, max_reuse_in_a_row=5),
        "draft": StepCachePolicy(threshold=1.6, max_reuse_in_a_row=8),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        dit = transformer.config
        if dit.guidance_embeds:
            raise ValueError(
                "this SANA transformer embeds a guidance scale (a SANA-Sprint checkpoint); SanaPipeline "
                "does not pass one: load it as a SanaSprintPipeline folder"
            )
        refuse_dynamic_shifting_without_mu(scheduler, "SanaPipeline")
        text_stage = self.text_stage(context)
        binning = ResolutionBinning(BINS_BY_SAMPLE_SIZE.get(dit.sample_size), dit.sample_size, "SanaPipeline")
        self.input_validation = self.validation(
            context,
            sana_default_sampling_params(),
            text_stage,
            "SanaPipeline",
            binning,
            unsupported_params={
                "true_cfg_scale": "SANA runs classic CFG, set by guidance_scale (with negative_prompt)",
            },
            cfg_mode="classic",
        )
        return [
            self.input_validation,
            text_stage,
            self.latent_stage(context, binning),
            DefaultTimestepPreparationStage(scheduler, patch_size=dit.patch_size, resolution_shift=False),
            DenoisingStage(SanaDenoiser(transformer, scheduler, context.dtype)),
            SanaDecodingStage(vae, binning),
        ]

    def validation(
        self,
        context: PipelineContext,
        defaults: SamplingParams,
        text_stage: SanaTextEncodingStage,
        pipeline_name: str,
        binning: ResolutionBinning,
        **options: Any,
    ) -> SanaInputValidationStage:
        """The input validation both SANA pipelines share: text only, the configured default size, the
        sequence limit of their text stage, the `use_resolution_binning` setting and the size rule that
        follows from it (`families/sana/validation.py`); `options`, the rest of `InputValidationStage`'s
        keywords."""
        return SanaInputValidationStage(
            binning=binning,
            generation_multiple=self.pixel_multiple,
            defaults=apply_overrides(defaults, context.folder_sampling_defaults),
            default_pixels=self.config.default_size,
            max_sequence_length_limit=self.sequence_limit(text_stage, context),
            image_inputs=ImageInputRule(pipeline_name=pipeline_name),
            **options,
        )

    def text_stage(self, context: PipelineContext) -> SanaTextEncodingStage:
        """Gemma-2 with SANA's prompt handling; also sets the pixel granularity from the VAE and DiT."""
        dit, vae = context.get("transformer").config, context.get("vae")
        self.vae_scale_factor = int(vae.spatial_compression_ratio)
        self.pixel_multiple = self.vae_scale_factor * dit.patch_size
        return SanaTextEncodingStage(
            context.get("tokenizer"),
            context.get("text_encoder"),
            self.config.complex_human_instruction,
            output_dtype=context.dtype,
        )

    @staticmethod
    def sequence_limit(text_stage: SanaTextEncodingStage, context: PipelineContext) -> int:
        """The longest max_sequence_length whose instructed prompt still fits Gemma-2's positions."""
        positions = int(context.get("text_encoder").config.max_position_embeddings)
        return positions - text_stage.longest_sequence(0)

    def latent_stage(
        self, context: PipelineContext, binning: ResolutionBinning
    ) -> SanaLatentPreparationStage:
        return SanaLatentPreparationStage(
            latent_channels=context.get("transformer").config.in_channels,
            vae_scale_factor=self.vae_scale_factor,
            device=context.platform.device(),
            binning=binning,
        )

    def batch_key(self, req: Req) -> tuple:
        """Text lengths may differ (the denoiser pads and masks); the latent grid must line up."""
        return (tuple(req.latents.shape[1:]), req.latent_size)


#: The one transformer sample_size Diffusers' SanaSprintPipeline bins sizes for (the 1024 px bins).
SPRINT_BINNED_SAMPLE_SIZE = 32


class SanaSprintPipeline(SanaPipeline):
    """SANA-Sprint: no negative prompt and no CFG; `guidance_scale` is embedded in the DiT."""

    config = SanaSprintPipelineConfig()
    #: Exact path only ("high"): SANA-Sprint samples in 1 to 4 SCM steps (2 by default), which leaves a
    #: tier at most a step or two to reuse, and no tier was measured at those counts.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {}

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        scheduler = context.get("scheduler")
        dit = transformer.config
        if not dit.guidance_embeds:
            raise ValueError(
                "SanaSprintPipeline needs a transformer that embeds the guidance scale (guidance_embeds=True); "
                "this one does not (a SanaPipeline checkpoint?)"
            )
        if not isinstance(scheduler, SCMScheduler):
            raise ValueError(f"SanaSprintPipeline samples with SCMScheduler, not {type(scheduler).__name__}")
        text_stage = self.text_stage(context)
        # Diffusers' SanaSprintPipeline bins for one sample_size only (the 1024 px bins).
        bins = ASPECT_RATIO_1024_BIN if dit.sample_size == SPRINT_BINNED_SAMPLE_SIZE else None
        binning = ResolutionBinning(bins, dit.sample_size, "SanaSprintPipeline")
        self.input_validation = self.validation(
            context,
            sana_sprint_default_sampling_params(),
            text_stage,
            "SanaSprintPipeline",
            binning,
            cfg_mode="none",
            unsupported_params={
                "true_cfg_scale": "SANA-Sprint embeds guidance_scale in the DiT and runs no CFG",
                "negative_prompt": "SANA-Sprint embeds guidance_scale in the DiT and reads no negative prompt",
            },
        )
        return [
            self.input_validation,
            text_stage,
            self.latent_stage(context, binning),
            SCMTimestepPreparationStage(
                scheduler,
                max_timesteps=self.config.max_timesteps,
                intermediate_timesteps=self.config.intermediate_timesteps,
                guidance_embeds_scale=float(dit.guidance_embeds_scale),
            ),
            DenoisingStage(SanaSprintDenoiser(transformer, scheduler, context.dtype)),
            SanaDecodingStage(context.get("vae"), binning, sigma_data=float(scheduler.config["sigma_data"])),
        ]
