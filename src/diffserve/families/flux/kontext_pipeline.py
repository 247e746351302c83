"""FLUX.1 Kontext (Diffusers `FluxKontextPipeline`): FLUX.1 image editing from one input image.

The input image is VAE-encoded once per request and its packed latents are appended to every row's
noisy image tokens, with their own position ids (first axis 1); the DiT is FLUX.1's, unchanged. Only the
prediction for the noisy tokens is kept. As in FLUX.1, guidance is the DiT's embedded guidance (3.5 by
default) and true CFG runs only with `true_cfg_scale > 1` and a negative prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from PIL import Image

from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.flux.conditioning import FluxKontextConditioning
from diffserve.families.flux.config import FluxKontextPipelineConfig
from diffserve.families.flux.kontext_preparation import (
    FluxKontextPreparationStage,
    kontext_area_size,
    kontext_condition_ids,
    kontext_condition_size,
)
from diffserve.families.flux.pipeline import FluxDenoiser, FluxPipeline
from diffserve.layers.rotary import RopeTables
from diffserve.pipelines.base import PipelineContext
from diffserve.pipelines.cfg_batch import BranchBatch, with_branch_conditions
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.input_validation import ImageInputRule


class FluxKontextDenoiser(FluxDenoiser):
    """One denoising step over Kontext requests that share the noisy grid and the input image's grid."""

    def rope_for(self, req: Req) -> RopeTables:
        """RoPE tables over [text; noisy tokens; input-image tokens], computed once per shape."""
        conditioning = FluxKontextConditioning.of(req)
        (_, rows, cols) = conditioning.condition_shapes[0]
        text_ids, image_ids = conditioning.text_ids, conditioning.image_ids
        assert text_ids is not None and image_ids is not None
        device, dtype = image_ids.device, image_ids.dtype
        key = (text_ids.shape[0], req.latent_size, rows, cols, dtype)

        def build() -> RopeTables:
            ids = torch.cat([image_ids, kontext_condition_ids(rows, cols, device, dtype)])
            return self.transformer.rope_tables(text_ids, ids)

        return self._rope_cache.get_or_build(key, device, build)

    def image_tokens(self, batch: BranchBatch, reqs: list[Req]) -> torch.Tensor:
        """Each branch's noisy tokens followed by its request's input-image tokens."""
        return with_branch_conditions(
            batch, reqs, lambda r: FluxKontextConditioning.of(r).condition_latents, 1
        )


class FluxKontextPipeline(FluxPipeline):
    """Edits one input image (required); see `FluxKontextPipelineConfig` for the output size."""

    config = FluxKontextPipelineConfig()
    denoiser_cls = FluxKontextDenoiser
    conditioning_type = FluxKontextConditioning
    controlnet_classes: ClassVar[dict[str, type]] = {}  # Diffusers has no ControlNet pipeline for it
    #: FLUX.1's medium and low (same DiT and blocks), checked on the tiny random-weight test model
    #: (`build_tiny_flux_kontext`, 20 steps, 32x32 output, a 32x32 input image, guidance 3.5, two prompts):
    #: medium 55.4-58.4 dB (7 of 20 steps in full), low 54.2-54.7 dB (5 steps), with or without the input's
    #: auto-resize. FLUX.1's draft computed as many steps as low there (5), so draft reuses up to 8 steps in
    #: a row instead of 5: 51.7-52.6 dB (4 steps; 48.7-50.0 dB at 8 steps). The tiny model's output barely
    #: moves between steps: calibrate a real checkpoint (`diffserve calibrate-cache`) before trusting them.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": FluxPipeline.step_cache_policies["medium"],
        "low": FluxPipeline.step_cache_policies["low"],
        "draft": StepCachePolicy(threshold=1.6, max_reuse_in_a_row=8),
    }

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(
            pipeline_name="FluxKontextPipeline", task="image-edit", min_images=1, max_images=1
        )

    def input_image_check(self) -> Callable[[Image.Image], object] | None:
        """The input image must leave a size to encode (`kontext_condition_size` refuses it otherwise)."""
        config, multiple = self.config, self.pixel_multiple
        return lambda image: kontext_condition_size(
            image, multiple, config.preferred_resolutions, config.auto_resize
        )

    def default_size(self, default_pixels: int) -> Callable[[SamplingParams], tuple[int, int]]:
        size = kontext_area_size(default_pixels, default_pixels, self.config.max_area, self.pixel_multiple)
        return lambda params: size

    def preparation_stages(self, context: PipelineContext) -> list[Stage]:
        """The input image's packed latents (its posterior's mode: no draw), then the initial noise."""
        return [
            FluxKontextPreparationStage(
                context.get("vae"),
                self.pixel_multiple,
                self.config.preferred_resolutions,
                self.config.auto_resize,
                device=context.platform.device(),
                dtype=context.dtype,
            ),
            self.latent_preparation_stage(context),
        ]

    def noising_stages(self, context: PipelineContext) -> list[Stage]:
        """None: Kontext starts from pure noise and reads its input image as extra tokens."""
        return []
