"""Z-Image (Diffusers `ZImagePipeline`): stages and the batched denoising step.

The DiT takes per-sample lists (captions of different lengths, latents of different sizes) and pads
and masks internally, so every request's positive and CFG-negative rows go through one forward, as
Diffusers does for one request. Z-Image predicts the negated flow velocity at "time" 1 - sigma; the
step negates it back before the shared Euler update. Diffusers' `cfg_truncation` and `cfg_normalization`
are request settings in `extra` (`config.py`), applied per request and step (`guided_predictions`).

The same folder serves image-to-image and inpainting (Diffusers' `ZImageImg2ImgPipeline`, strength 0.6 by
default, and `ZImageInpaintPipeline`, 1.0 with a mask). Diffusers encodes the input image at its own size
(floored to the pixel multiple), which is diffserve's default output size for it; another size resizes it.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import torch

from diffserve.configs.cache_settings import EasyCacheSettings, TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.z_image.conditioning import ZImageConditioning
from diffserve.families.z_image.config import (
    ZImagePipelineConfig,
    z_image_default_sampling_params,
    z_image_settings,
)
from diffserve.families.z_image.folder_checks import check_z_image_folder
from diffserve.families.z_image.stages import ZImageTextEncodingStage, ZImageTimestepPreparationStage
from diffserve.layers.lora_rows import request_lora_scope
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.z_image import RefinedCaption, ZImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, branch_texts, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.image_to_image import (
    ImageToImageNoisingStage,
    InputImageEncodingStage,
    spatial_latents,
)
from diffserve.stages.input_validation import FamilySettingsValidationStage, one_image_input_validation
from diffserve.stages.latent_preparation import SpatialLatentPreparationStage
from diffserve.stages.mask_preparation import InpaintMaskStage


def z_image_cfg(positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    """Z-Image's guidance: `positive + scale * (positive - negative)`, in float32."""
    positive, negative = positive.float(), negative.float()
    return positive + scale * (positive - negative)


def z_image_step_cfg(
    positive: torch.Tensor, negative: torch.Tensor, scale: float, *, step_scale: float, normalization: float
) -> torch.Tensor:
    """One step's guidance, as Diffusers' ZImagePipeline: the prompt branch alone where `cfg_truncation` set
    the step's scale to 0; else `z_image_cfg` at `step_scale`, then, with `normalization` > 0, each
    output's guided prediction scaled down to at most `normalization` times its prompt branch's norm (over
    the whole latent). `scale` (the request's scale) is what `split_guided` passes; `step_scale` replaces it."""
    if step_scale <= 0:
        return positive.float()
    guided = z_image_cfg(positive, negative, step_scale)
    if normalization <= 0:
        return guided
    rows = []
    for pos, pred in zip(positive.float(), guided, strict=True):
        limit = torch.linalg.vector_norm(pos) * normalization
        norm = torch.linalg.vector_norm(pred)
        rows.append(pred * (limit / norm) if norm > limit else pred)
    return torch.stack(rows)


def guided_predictions(prediction: torch.Tensor, reqs: list[Req]) -> list[torch.Tensor]:
    """Each request's prediction from its rows of `prediction` (`cfg_batch` order), guided at its step's
    CFG scale with its `cfg_normalization`. A request without either refinement gets `z_image_cfg` as before."""
    out, offset = [], 0
    for req in reqs:
        rows = req.batch_size * (2 if req.do_cfg else 1)
        conditioning = ZImageConditioning.of(req)
        step_scale = conditioning.cfg_scales[req.step_index]
        normalization = conditioning.cfg_normalization or 0.0
        if step_scale == req.cfg_scale and normalization <= 0:
            combine = z_image_cfg
        else:
            combine = partial(z_image_step_cfg, step_scale=step_scale, normalization=normalization)
        out.extend(split_guided(prediction[offset : offset + rows], [req], combine=combine))
        offset += rows
    return out


class ZImageDenoiser:
    def __init__(self, transformer: ZImageTransformer2DModel, scheduler: FlowMatchEulerScheduler) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.dtype = next(transformer.parameters()).dtype

    def context_for(self, req: Req) -> list[RefinedCaption]:
        """The request's captions (every row of its text branches) through the DiT's caption embedder
        and context refiner, once per request: neither depends on the step. On the benchmark checkpoint
        that is about 5% of a step; on Z-Image-Turbo (2 refiner layers next to 30 main layers over a
        longer sequence) well under 1%."""
        if req.dit_context is None:
            with request_lora_scope(req.loras):
                req.dit_context = self.transformer.refine_captions(
                    [row for text in branch_texts(req) for row in text.unbind(0)]
                )
        return req.dit_context

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        # Rows in `cfg_batch` order (per request: positive rows, then negative ones), which is what
        # `step_cache_for` and `split_guided` expect.
        latents, captions, times = [], [], []
        for req in reqs:
            # The DiT's time runs from 0 (noise) to 1 (clean): 1 - t / 1000, prepared on the device.
            t = ZImageConditioning.of(req).dit_timesteps[req.step_index]
            for _ in branch_texts(req):
                latents.extend(req.latents.to(self.dtype).unsqueeze(2).unbind(0))
                times.append(t.expand(req.batch_size))
            captions.extend(self.context_for(req))
        out = self.transformer(
            latents, torch.cat(times), refined_captions=captions, step_cache=step_cache_for(reqs)
        )
        prediction = torch.stack([o.float() for o in out]).squeeze(2)
        guided = guided_predictions(prediction, reqs)
        advance_requests(self.scheduler, reqs, [-p for p in guided])


class ZImagePipeline(Pipeline):
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = ZImagePipelineConfig()
    conditioning_type = ZImageConditioning
    #: Chosen by `diffserve calibrate-cache` on the tiny random-weight test model (`build_tiny_zimage`, 20
    #: steps, 64x64, CFG 5, the four built-in prompts, 1 dB margin, every candidate also holding the bar at 4
    #: and 8 steps), a preset replacing the former step-cache threshold only where it computes fewer DiT
    #: blocks: medium EasyCache 36.0 blocks of 60 at 36.3 dB (the step cache: 36.8 at 36.6 dB), low the step
    #: cache 24 at 31.9 dB, draft TeaCache 12 at 28.4 dB (the step cache: 15 at 28.2 dB, and 23.6 dB at 8
    #: steps). Real checkpoints move differently: calibrate them (`diffserve calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": EasyCacheSettings(reuse_threshold=0.5),
        "low": StepCachePolicy(threshold=0.15, max_reuse_in_a_row=3),
        "draft": TeaCacheSettings(rel_l1_thresh=0.45),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        check_z_image_folder(transformer, vae, context.get("text_encoder"))
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * 2
        default = self.config.default_pixels
        device = context.platform.device()
        self.input_validation = one_image_input_validation(
            "ZImagePipeline",
            defaults=apply_overrides(z_image_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=default,
            max_sequence_length_limit=self.config.max_sequence_length_limit,
            default_strength=self.config.default_strength,
            default_inpaint_strength=self.config.default_inpaint_strength,
            unsupported_params={
                "true_cfg_scale": "Z-Image's CFG is set by guidance_scale (> 0 turns it on, with negative_prompt)"
            },
            cfg_mode="positive_gap",
            stage_cls=FamilySettingsValidationStage,
            settings=z_image_settings,  # cfg_truncation, cfg_normalization
        )
        return [
            self.input_validation,
            ZImageTextEncodingStage(
                context.get("tokenizer"), context.get("text_encoder"), output_dtype=context.dtype
            ),
            # Z-Image keeps its latents in float32 whatever the DiT's dtype, as Diffusers does. Image-to-image:
            # the input image's latents are the generator's first draw.
            InputImageEncodingStage(vae, spatial_latents, device=device, dtype=torch.float32),
            SpatialLatentPreparationStage(
                latent_channels=transformer.config.in_channels,
                vae_scale_factor=self.vae_scale_factor,
                device=device,
                dtype=torch.float32,
            ),
            ZImageTimestepPreparationStage(scheduler),
            ImageToImageNoisingStage(),
            InpaintMaskStage(transformer.config.in_channels, spatial_latents),
            DenoisingStage(ZImageDenoiser(transformer, scheduler)),
            DecodingStage(vae, packed_latents=False),
        ]

    def batch_key(self, req: Req) -> tuple:
        """The DiT pads captions itself; only the latent grid has to match (predictions are stacked)."""
        return (tuple(req.latents.shape[1:]),)
