"""Qwen-Image 2.1 (Diffusers `QwenImage21Pipeline`), text to image and, with input images, image-conditioned
(`conditioning.py`: the images in the prompt's vision slots and, VAE-encoded, in the DiT's prefix; the
output size defaults to the last image's aspect ratio; Diffusers' `output_resolution`, the side whose
square is the condition images' area and the default size, is a request's `extra` setting): Qwen3-VL
prompt states, the block-causal single-stream DiT (`models/dits/qwen_image21.py`) on unpatched 64-channel
latents of its 16x VAE, flow-matching Euler steps, true CFG (`negative + scale * (positive - negative)`, on
when true_cfg_scale > 1 and a negative prompt is given; the model is meant to run without it).

Every request's prompt and negative-prompt branches go through one DiT forward; requests at different steps,
with prompts of different lengths and with or without condition images share it (the DiT keeps each row's
own prefix). Diffusers
caches the text's keys and values after the first step (`use_kv_cache`); diffserve recomputes them, which
is its `use_kv_cache=False` (the same values in float32; in reduced precision Diffusers documents that the
two settings differ by rounding).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.cache_settings import TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.families.qwen_image21.conditioning import (
    QwenImage21Conditioning,
    QwenImage21ConditionStage,
    default_output_size,
    vision_pixel_bounds,
)
from diffserve.families.qwen_image21.config import (
    SAMPLE_SIGMAS_KEY,
    QwenImage21PipelineConfig,
    output_resolution,
    qwen_image21_default_sampling_params,
)
from diffserve.families.qwen_image21.folder_checks import check_qwen_image21_folder
from diffserve.families.qwen_image21.stages import (
    PIPELINE_NAME,
    QwenImage21DecodingStage,
    QwenImage21InputValidationStage,
    QwenImage21LatentPreparationStage,
    QwenImage21TimestepPreparationStage,
)
from diffserve.families.qwen_image21.text_encoding import QwenImage21TextEncodingStage
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, branch_texts, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule


class QwenImage21Denoiser:
    """One step over a list of Qwen-Image 2.1 requests of one latent grid, each at its own timestep."""

    def __init__(
        self, transformer: QwenImage21Transformer2DModel, scheduler: FlowMatchEulerScheduler
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        latents, texts, lengths, timesteps, conditions = [], [], [], [], []
        for req in reqs:
            t = req.schedule.timesteps[req.step_index]
            conditioning = QwenImage21Conditioning.of(req)
            for branch, text in enumerate(branch_texts(req)):
                latents.append(req.latents)
                texts.append(text)
                lengths.extend([text.shape[1]] * req.batch_size)
                timesteps.append(t.expand(req.batch_size))
                conditions.extend([conditioning.blocks(branch)] * req.batch_size)
        longest = max(lengths)
        text = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[1])) for t in texts])
        first = reqs[0]
        prediction = self.transformer(
            hidden_states=torch.cat(latents),
            encoder_hidden_states=text,
            text_lengths=lengths,
            timestep=torch.cat(timesteps).to(first.latents.dtype) / 1000,
            grid=tuple(first.latent_size),
            conditions=conditions,
            step_cache=step_cache_for(reqs),  # rows: each request's branches in turn, as it expects
        )
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))


def sample_sigmas(context: PipelineContext) -> tuple[float, ...] | None:
    """The folder's `sample_sigmas` (model_index.json), checked: a non-empty list of numbers, or None."""
    value = context.pipeline_options.get(SAMPLE_SIGMAS_KEY)
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"{PIPELINE_NAME}: model_index.json's {SAMPLE_SIGMAS_KEY} must be a list of numbers")
    return tuple(float(v) for v in value)


class QwenImage21Pipeline(Pipeline):
    required_components = ("text_encoder", "processor", "vae", "transformer", "scheduler")
    config = QwenImage21PipelineConfig()
    pipeline_name = PIPELINE_NAME
    conditioning_type = QwenImage21Conditioning
    #: Diffusers sets no limit on condition images; this bounds one request's encoder and DiT prefix.
    max_input_images = 8
    #: Measured on the tiny random-weight test model (`build_tiny_qwen_image21`, 20 steps, 64x64, no CFG as
    #: the family's default, the four built-in prompts of `diffserve calibrate-cache`, 1 dB margin, every
    #: preset also holding its bar at 4 and 8 steps): TeaCache (the raw change) at 0.3, 0.45 and 0.55, 20, 19
    #: and 15 of 20 steps in full (40, 38 and 30 DiT blocks of 40) at identical pixels, 35.8 and 27.0 dB; at 4
    #: and 8 steps none of them reuses a step. Reuse costs this tiny DiT dearly (one step reused: 35.8 dB,
    #: six: 25.7 dB), so medium reuses none: the one preset that reuses a step above 36 dB, DBCache F1B0
    #: reusing one step's last block (39.2 dB), keeps 35.4 dB on other prompts and 25.8 dB at 8 steps. Real
    #: checkpoints move differently: calibrate them (`diffserve calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": TeaCacheSettings(rel_l1_thresh=0.3),
        "low": TeaCacheSettings(rel_l1_thresh=0.45),
        "draft": TeaCacheSettings(rel_l1_thresh=0.55),
    }
    #: DBCache keeps the CFG branch apart (`enable_separate_cfg`), as cache-dit does for Qwen-Image: the
    #: negative prompt is a forward of its own in Diffusers' pipeline.
    cache_separate_cfg = True

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        scale = self.config.vae_scale_factor
        check_qwen_image21_folder(transformer, vae, context.get("text_encoder"), scale)
        self.pixel_multiple = scale * 2
        fixed = sample_sigmas(context)
        steps = (
            len(fixed) if fixed is not None else qwen_image21_default_sampling_params().num_inference_steps
        )
        size = self.config.default_resolution
        vision_pixels = vision_pixel_bounds(context.get("processor"))
        self.input_validation = QwenImage21InputValidationStage(
            sample_sigmas=fixed,
            rgba=int(vae.config["out_channels"]) == 4,
            defaults=apply_overrides(
                qwen_image21_default_sampling_params(steps), context.folder_sampling_defaults
            ),
            pixel_multiple=self.pixel_multiple,
            default_pixels=size,
            max_sequence_length_limit=None,
            default_size=lambda params: default_output_size(
                params, output_resolution(params, size), self.pixel_multiple, vision_pixels
            ),
            image_inputs=ImageInputRule(
                pipeline_name=self.pipeline_name,
                max_images=self.max_input_images,
                keep_alpha=True,  # composited over white for the text encoder; the RGBA VAE reads alpha
            ),
            unsupported_params={
                "guidance_scale": "Qwen-Image 2.1 is not guidance-distilled; use true_cfg_scale with a negative_prompt",
                "max_sequence_length": "Qwen-Image 2.1 reads the whole prompt (Diffusers does not truncate it)",
            },
        )
        return [
            self.input_validation,
            QwenImage21ConditionStage(vae, size, context.platform.device(), context.dtype),
            QwenImage21TextEncodingStage(
                context.get("processor"),
                context.get("text_encoder"),
                self.config.template,
                self.config.image_slot,
                self.config.system_prompt,
                context.dtype,
            ),
            QwenImage21LatentPreparationStage(
                transformer.config.in_channels, scale, context.platform.device(), context.dtype
            ),
            QwenImage21TimestepPreparationStage(scheduler, fixed),
            DenoisingStage(QwenImage21Denoiser(transformer, scheduler)),
            QwenImage21DecodingStage(vae),
        ]

    def batch_key(self, req: Req) -> tuple:
        """Text lengths may differ (the DiT keeps each row's own); the latent grid must agree."""
        return (tuple(req.latents.shape[1:]), req.latent_size)
