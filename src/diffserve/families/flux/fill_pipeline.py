"""FLUX.1 Fill (Diffusers `FluxFillPipeline`): inpainting and outpainting from an input image and a mask.

Its DiT reads, with every noisy image token, the masked input image's latents and the mask's pixels as
extra channels (`families/flux/fill_preparation.py`); the rest is FLUX.1's: text encoders, schedule
(truncated by `strength`, 1.0 by default, as in Diffusers) and embedded guidance (30 by default). Unlike
`FluxInpaintPipeline` it does not blend the input image back after each step: the DiT itself keeps it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.flux.conditioning import FluxFillConditioning
from diffserve.families.flux.config import FluxFillPipelineConfig, flux_fill_default_sampling_params
from diffserve.families.flux.fill_preparation import FluxFillPreparationStage
from diffserve.families.flux.pipeline import FluxDenoiser, FluxPipeline
from diffserve.pipelines.base import PipelineContext
from diffserve.pipelines.cfg_batch import BranchBatch, with_branch_conditions
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.image_to_image import ImageToImageNoisingStage
from diffserve.stages.input_validation import ImageInputRule


class FluxFillDenoiser(FluxDenoiser):
    """One step over Fill requests: each branch's noisy tokens widened by its request's condition channels."""

    def image_tokens(self, batch: BranchBatch, reqs: list[Req]) -> torch.Tensor:
        return with_branch_conditions(batch, reqs, lambda r: FluxFillConditioning.of(r).channel_condition, 2)


class FluxFillPipeline(FluxPipeline):
    """Fills the masked area of one input image (both required; the mask as `diffserve.masks` reads it)."""

    config = FluxFillPipelineConfig()
    denoiser_cls = FluxFillDenoiser
    conditioning_type = FluxFillConditioning
    controlnet_classes: ClassVar[dict[str, type]] = {}  # Diffusers has no ControlNet pipeline for it
    #: FLUX.1's medium and low (same DiT and blocks), checked on the tiny random-weight test model
    #: (`build_tiny_flux_fill`, 20 steps, 32x32, a 16x16 mask, guidance 30, two prompts): medium 50.0-51.2
    #: dB (7 of 20 steps in full), low 50.0-50.6 dB (5 steps). FLUX.1's draft computed as many steps as low
    #: there (5), so draft reuses up to 8 steps in a row instead of 5: 47.3-47.8 dB (4 steps; 44.7-46.1 dB
    #: at 8 steps). The tiny model's output barely moves between steps: calibrate a real checkpoint
    #: (`diffserve calibrate-cache`) before trusting them.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": FluxPipeline.step_cache_policies["medium"],
        "low": FluxPipeline.step_cache_policies["low"],
        "draft": StepCachePolicy(threshold=1.6, max_reuse_in_a_row=8),
    }

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(
            pipeline_name="FluxFillPipeline",
            task="image-edit",
            min_images=1,
            max_images=1,
            inpainting=True,
            default_strength=self.config.default_strength,
            mask_required=True,
        )

    def default_sampling_params(self) -> SamplingParams:
        return flux_fill_default_sampling_params()

    def condition_channels(self) -> int:
        """Per image token, the masked image's packed latents (4 x latent channels) and the mask's s x s
        pixels per latent pixel, packed 2x2 (4 x s^2; s the VAE's scale factor): `FluxFillPreparationStage`."""
        return 4 * self.latent_channels + 4 * self.vae_scale_factor**2

    def preparation_stages(self, context: PipelineContext) -> list[Stage]:
        """Diffusers' draw order: the input image's latents, the initial noise, then the masked image's."""
        return [
            *super().preparation_stages(context),
            FluxFillPreparationStage(
                context.get("vae"), self.vae_scale_factor, context.platform.device(), context.dtype
            ),
        ]

    def noising_stages(self, context: PipelineContext) -> list[Stage]:
        return [ImageToImageNoisingStage()]
