"""HunyuanVideo 1.0 (Diffusers `HunyuanVideoPipeline`): Llama states (templated, cropped, masked) and CLIP's
pooled text, the double/single-stream DiT (`models/dits/hunyuan_video.py`) on HunyuanVideo's VAE latents,
flow-matching Euler steps over shifted linear sigmas.

Guidance, as in Diffusers: the guidance-distilled DiT embeds `guidance_scale` (times 1000, in the DiT's
dtype) at every step; true CFG runs only with `true_cfg_scale > 1` and a negative prompt, its branch
sharing the request's DiT forward (`negative + scale * (positive - negative)`, in the DiT's dtype).

Dtypes, as in Diffusers: the noise is drawn in float32; the DiT reads the latents in its dtype and the
timesteps in the latents' dtype; the Euler step runs in float32 and leaves the latents in the
prediction's dtype (float32 at the start, the DiT's after the first step).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.quality import TierPreset
from diffserve.families.hunyuan_video.conditioning import HunyuanVideoConditioning
from diffserve.families.hunyuan_video.config import (
    HunyuanVideoPipelineConfig,
    hunyuan_video_default_sampling_params,
)
from diffserve.families.hunyuan_video.stages import (
    HunyuanVideoDecodingStage,
    HunyuanVideoTimestepPreparationStage,
)
from diffserve.families.hunyuan_video.text_encoding import HunyuanVideoTextEncodingStage
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, split_guided
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage, VideoRule
from diffserve.stages.latent_preparation import VideoLatentPreparationStage


def branch_inputs(req: Req) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(Llama states, mask, pooled CLIP text) per branch in row order: the prompt's, then the negative's."""
    c = HunyuanVideoConditioning.of(req)
    branches = [(req.prompt_embeds, c.text_mask, req.pooled_prompt_embeds)]
    if req.do_cfg:
        branches.append((req.negative_prompt_embeds, c.negative_text_mask, req.negative_pooled_prompt_embeds))
    return branches


class HunyuanVideoDenoiser:
    """One step over a list of HunyuanVideo requests of one latent shape, each at its own timestep."""

    def __init__(
        self,
        transformer: HunyuanVideoTransformer3DModel,
        scheduler,
        dtype: torch.dtype,
        guidance_multiplier: float,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.dtype = dtype
        self.guidance_multiplier = guidance_multiplier

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        latents, timesteps, texts, masks, pooled, guidance = [], [], [], [], [], []
        for req in reqs:
            t = req.schedule.timesteps[req.step_index].to(req.latents.dtype).expand(req.batch_size)
            for states, mask, pool in branch_inputs(req):
                latents.append(req.latents.to(self.dtype))
                timesteps.append(t)
                texts.append(states)
                masks.append(mask)
                pooled.append(pool)
                if req.schedule.guidance is not None:
                    guidance.append(req.schedule.guidance.to(self.dtype) * self.guidance_multiplier)
        prediction = self.transformer(
            hidden_states=torch.cat(latents),
            timestep=torch.cat(timesteps),
            encoder_hidden_states=torch.cat(texts),
            encoder_attention_mask=torch.cat(masks),
            pooled_projections=torch.cat(pooled),
            guidance=torch.cat(guidance) if guidance else None,
        )
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))


class HunyuanVideoPipeline(Pipeline):
    required_components = (
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
        "vae",
        "transformer",
        "scheduler",
    )
    config = HunyuanVideoPipelineConfig()
    pipeline_name = "HunyuanVideoPipeline"
    conditioning_type = HunyuanVideoConditioning
    #: No calibrated quality tiers yet: only "high", the exact path.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {}

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        text_encoder = context.get("text_encoder")
        dit = transformer.config
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = self.spatial * dit.patch_size
        size = (self.config.default_height, self.config.default_width)
        self.input_validation = InputValidationStage(
            defaults=apply_overrides(
                hunyuan_video_default_sampling_params(), context.folder_sampling_defaults
            ),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_height,
            max_sequence_length_limit=int(text_encoder.config.max_position_embeddings)
            - self.config.crop_start,
            cfg_mode="true_cfg",
            image_inputs=ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video"),
            default_size=lambda _params: size,
            video=VideoRule(temporal_factor=self.temporal),
        )
        self.denoiser = HunyuanVideoDenoiser(
            transformer, scheduler, context.dtype, self.config.guidance_multiplier
        )
        return [
            self.input_validation,
            HunyuanVideoTextEncodingStage(
                context.get("tokenizer"),
                text_encoder,
                context.get("tokenizer_2"),
                context.get("text_encoder_2"),
                self.config,
                output_dtype=context.dtype,
            ),
            VideoLatentPreparationStage(
                channels=dit.in_channels,
                spatial=self.spatial,
                temporal=self.temporal,
                device=context.platform.device(),
            ),
            HunyuanVideoTimestepPreparationStage(scheduler, dit.guidance_embeds),
            DenoisingStage(self.denoiser),
            HunyuanVideoDecodingStage(vae),
        ]
