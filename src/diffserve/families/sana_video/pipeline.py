"""SANA-Video (Diffusers `SanaVideoPipeline`): Gemma-2 text, SANA's linear-attention DiT carried to video
(`models/dits/sana_video.py`) on Wan 2.1 VAE latents, flow DPM-Solver++, classic CFG.

Every request's prompt and negative-prompt branches go through one DiT forward (Diffusers concatenates
them too). Each text keeps only its real tokens (`stages.py`); the denoiser embeds each branch once per
request, right-pads the embedded texts to the longest in the batch and masks the padding, which the
cross-attention weighs exactly 0, as Diffusers weighs its own padding. Latents and the scheduler stay
float32 whatever the DiT's dtype, as in Diffusers. `use_resolution_binning` (on by default, as in
Diffusers) is a request setting in `SamplingParams.extra`. The VAE is Wan 2.1's (the 480p folders) or
LTX-2's (the 720p folders: 32x spatial and 8x temporal compression, so frames 8k+1).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.cache_settings import EasyCacheSettings, TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.sana_video.config import (
    SanaVideoPipelineConfig,
    sana_video_default_sampling_params,
)
from diffserve.families.sana_video.stages import (
    ResolutionBins,
    SanaVideoDecodingStage,
    SanaVideoInputValidationStage,
    SanaVideoLatentPreparationStage,
    SanaVideoTextEncodingStage,
)
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu
from diffserve.models.dits.sana_video import SanaVideoTransformer3DModel
from diffserve.models.vaes.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.padded_text_denoiser import PaddedTextDenoiser
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, VideoRule
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage

PIPELINE_NAME = "SanaVideoPipeline"


class SanaVideoDenoiser(PaddedTextDenoiser):
    """One step over a list of SANA-Video requests (same latent grid), each at its own timestep; the DiT
    reads the scheduler's timesteps as they are."""

    transformer: SanaVideoTransformer3DModel


class SanaVideoPipeline(Pipeline):
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = SanaVideoPipelineConfig()
    #: Picked by hand on the tiny random-weight test model (`build_tiny_sana_video`, 20 steps, 32x32, 5
    #: frames, binning off, CFG 6, four prompts: the quality-tier test's two and two short
    #: ones; `calibrate-cache` cannot turn the binning off), from a grid of the step cache,
    #: EasyCache and TeaCache: medium EasyCache at 0.7, 35.9-45.9 dB (17-19 of 20 steps in full); low
    #: TeaCache at 0.8, 31.2-34.9 dB (14-15 steps); draft the step cache at 1.2, 25.1-28.8 dB (11 steps).
    #: Bolder rungs fall under a bar on one of the prompts (the step cache at 1.6: 23.5 dB; TeaCache at
    #: 0.5 reuses one step and drops to 32.0 dB). At 8 steps low and draft fall to 22.2 and 21.8 dB on
    #: some prompts (medium 31.9 dB at worst): the tiny DiT moves a lot a step. Real checkpoints move
    #: differently: calibrate them (`diffserve calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": EasyCacheSettings(reuse_threshold=0.7),
        "low": TeaCacheSettings(rel_l1_thresh=0.8),
        "draft": StepCachePolicy(threshold=1.2, max_reuse_in_a_row=5),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        dit = transformer.config
        if dit.guidance_embeds:
            raise ValueError(
                "this SANA-Video transformer embeds a guidance scale (guidance_embeds=True); "
                f"{PIPELINE_NAME} passes none (Diffusers' cannot run it either)"
            )
        refuse_dynamic_shifting_without_mu(scheduler, PIPELINE_NAME)
        if isinstance(vae, AutoencoderKLLTX2Video) and vae.config["timestep_conditioning"]:
            raise ValueError(
                f"this LTX-2 VAE's decoder takes a decode timestep (timestep_conditioning=True); {PIPELINE_NAME} "
                "passes none (Diffusers' cannot decode with it either)"
            )
        # Wan 2.1's VAE (8x, 4x) or LTX-2's (32x, 8x): the latent grid and the frame rule follow it.
        spatial = int(vae.spatial_compression_ratio)
        temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = max(self.config.pixel_multiple, spatial * dit.patch_size[1])
        text_stage = SanaVideoTextEncodingStage(
            context.get("tokenizer"),
            context.get("text_encoder"),
            self.config.complex_human_instruction,
            output_dtype=context.dtype,
        )
        positions = int(context.get("text_encoder").config.max_position_embeddings)
        bins = ResolutionBins(int(dit.sample_size))
        self.input_validation = SanaVideoInputValidationStage(
            defaults=apply_overrides(sana_video_default_sampling_params(), context.folder_sampling_defaults),
            default_pixels=self.config.default_height,
            max_sequence_length_limit=positions - text_stage.longest_sequence(0),
            cfg_mode="classic",
            image_inputs=ImageInputRule(pipeline_name=PIPELINE_NAME, task="text-to-video"),
            default_size=lambda _params: (self.config.default_height, self.config.default_width),
            unsupported_params={
                "true_cfg_scale": "SANA-Video runs classic CFG, set by guidance_scale (> 1 turns it on)",
            },
            video=VideoRule(temporal_factor=temporal),
            bins=bins,
            generation_multiple=self.pixel_multiple,
            min_side=2 * spatial if self.reflect_padded(vae) else 0,
        )
        return [
            self.input_validation,
            text_stage,
            SanaVideoLatentPreparationStage(
                channels=int(dit.in_channels),
                spatial=spatial,
                temporal=temporal,
                bins=bins,
                device=context.platform.device(),
            ),
            DefaultTimestepPreparationStage(scheduler, patch_size=dit.patch_size[1], resolution_shift=False),
            DenoisingStage(SanaVideoDenoiser(transformer, scheduler, context.dtype)),
            SanaVideoDecodingStage(vae),
        ]

    @staticmethod
    def reflect_padded(vae: torch.nn.Module) -> bool:
        """Whether the VAE's decoder pads by reflection (LTX-2's), which one latent row cannot do."""
        return (
            isinstance(vae, AutoencoderKLLTX2Video)
            and vae.config["decoder_spatial_padding_mode"] == "reflect"
        )

    def batch_key(self, req: Req) -> tuple:
        """Text lengths may differ (the denoiser pads and masks); the latent grid must line up."""
        return (tuple(req.latents.shape[1:]), req.latent_size)
