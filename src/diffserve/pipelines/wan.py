"""Wan 2.1 (Diffusers `WanPipeline`, `WanImageToVideoPipeline`): stages and the batched denoising step.

Classic CFG as in Diffusers (`uncond + scale * (cond - uncond)` when guidance_scale > 1), but the two
branches of every request share one DiT forward. Image-to-video adds the first-frame conditioning
latents on the channel axis and the CLIP image tokens for the DiT's image cross-attention.
"""

from __future__ import annotations

import torch

from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.configs.wan import WanPipelineConfig, wan_default_sampling_params
from diffserve.errors import ModelLoadError
from diffserve.layers.lora_rows import request_lora_scope
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.wan import EmbeddedContext, WanTransformer3DModel
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, branch_texts, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage, VideoRule
from diffserve.stages.latent_preparation import initial_noise
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage
from diffserve.stages.video_vae_decoding import VideoVaeDecodingStage
from diffserve.stages.wan_image_to_video_preparation import (
    WanImageToVideoPreparationStage,
    image_to_video_size,
)
from diffserve.stages.wan_text_encoding import WanTextEncodingStage


class VideoLatentPreparationStage(Stage):
    """Float32 noise of shape (batch, channels, latent frames, h, w), drawn on the request's CPU generator."""

    needs = ("generator", "prompt_embeds")
    sets = ("latents", "latent_height", "latent_width")

    def __init__(self, channels: int, spatial: int, temporal: int, device: torch.device) -> None:
        self.channels, self.spatial, self.temporal, self.device = channels, spatial, temporal, device

    def forward(self, req: Req) -> Req:
        p = req.params
        frames = (p.num_frames - 1) // self.temporal + 1
        h, w = p.height // self.spatial, p.width // self.spatial
        shape = (p.num_outputs_per_prompt, self.channels, frames, h, w)
        req.latents = initial_noise(req, shape, torch.float32).to(self.device)
        req.latent_height, req.latent_width = h, w
        return req


class WanDenoiser:
    """One step over a list of Wan requests of one latent shape, each at its own timestep."""

    def __init__(self, transformer: WanTransformer3DModel, scheduler) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.dtype = next(transformer.parameters()).dtype

    def context_for(self, req: Req) -> EmbeddedContext:
        """The request's cross-attention context (text, and the CLIP image states for I2V, of each CFG
        branch) through the DiT's embedders, once per request: no step changes them, and the text
        embedder alone is an MLP over 512 tokens per branch."""
        if req.dit_context is None:
            texts = branch_texts(req)
            images = [req.image_embeds] * len(texts) if req.image_embeds is not None else None
            with request_lora_scope(req.loras):
                req.dit_context = self.transformer.embed_context(
                    torch.cat(texts), torch.cat(images) if images else None
                )
        return req.dit_context

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        # Rows in `cfg_batch` order (per request: positive rows, then negative ones), which is what
        # `step_cache_for` and `split_guided` expect.
        latents, timesteps = [], []
        for req in reqs:
            model_input = req.latents
            if req.condition_latents is not None:
                model_input = torch.cat([model_input, req.condition_latents], dim=1)
            for _branch in range(2 if req.do_cfg else 1):
                latents.append(model_input)
                timesteps.append(req.timesteps[req.step_index].expand(req.batch_size))
        contexts = [self.context_for(req) for req in reqs]
        prediction = self.transformer(
            hidden_states=torch.cat(latents).to(self.dtype),
            timestep=torch.cat(timesteps),  # already on the latents' device
            encoder_hidden_states=None,
            context=EmbeddedContext(torch.cat([c.states for c in contexts]), contexts[0].image_len),
            step_cache=step_cache_for(reqs),
        )
        advance_requests(self.scheduler, reqs, split_guided(prediction.float(), reqs))


class WanPipeline(Pipeline):
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = WanPipelineConfig()
    pipeline_name = "WanPipeline"
    #: Measured on the tiny random-weight T2V test model (`build_tiny_wan`, 20 steps, 64x64, 9 frames,
    #: CFG 5, six prompts): 18-20 / 16 / 13 steps in full for medium / low / draft at >38 / 32.6 / 29.7 dB
    #: mean PSNR against the exact output (worst prompt 35.9 / 30.4 / 28.7). Its signal moves 0.45-0.9 a
    #: step, so these thresholds pick single steps to skip, and its blocks' residual changes about as much
    #: as it is large, so reuse is costly on it. Real checkpoints move differently: `diffserve
    #: calibrate-cache` writes per-checkpoint thresholds.
    step_cache_policies = {
        "medium": StepCachePolicy(threshold=0.45, max_reuse_in_a_row=1),
        "low": StepCachePolicy(threshold=0.6, max_reuse_in_a_row=2),
        "draft": StepCachePolicy(threshold=0.75, max_reuse_in_a_row=2),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        options = context.pipeline_options
        if options.get("boundary_ratio") is not None or options.get("expand_timesteps"):
            raise ModelLoadError(
                "this is a Wan 2.2 checkpoint (model_index.json sets boundary_ratio or expand_timesteps); "
                "diffserve supports Wan 2.1 only so far"
            )
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = self.spatial * transformer.config.patch_size[1]
        self.input_validation = InputValidationStage(
            defaults=apply_overrides(wan_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_height,
            max_sequence_length_limit=self.config.max_sequence_length_limit,
            cfg_mode="classic",
            image_inputs=self.image_input_rule(),
            default_size=self.default_size,
            unsupported_params={
                "true_cfg_scale": "Wan runs classic CFG, set by guidance_scale (> 1 turns it on)"
            },
            video=VideoRule(temporal_factor=self.temporal),
        )
        return [
            self.input_validation,
            *self.before_denoising_stages(context),
            WanTextEncodingStage(
                context.get("tokenizer"), context.get("text_encoder"), output_dtype=context.dtype
            ),
            VideoLatentPreparationStage(
                channels=int(vae.config["z_dim"]),
                spatial=self.spatial,
                temporal=self.temporal,
                device=context.platform.device(),
            ),
            DefaultTimestepPreparationStage(scheduler, patch_size=transformer.config.patch_size[1]),
            DenoisingStage(WanDenoiser(transformer, scheduler)),
            VideoVaeDecodingStage(vae),
        ]

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video")

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        return self.config.default_height, self.config.default_width

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        return []


class WanImageToVideoPipeline(WanPipeline):
    """Animates one input image; the output keeps its aspect ratio unless height/width are given."""

    required_components = (*WanPipeline.required_components, "image_encoder", "image_processor")
    pipeline_name = "WanImageToVideoPipeline"
    #: Measured like WanPipeline's on the tiny I2V test model (64x64 input image, six prompts): 19-20 / 18 /
    #: 16-18 steps in full at >41 / 35.0 / 31.7 dB mean (worst prompt 39.5 / 34.3 / 27.0). Reuse costs more
    #: here than in T2V: a threshold of 0.6 already falls to 26 dB.
    step_cache_policies = {
        "medium": StepCachePolicy(threshold=0.45, max_reuse_in_a_row=1),
        "low": StepCachePolicy(threshold=0.5, max_reuse_in_a_row=2),
        "draft": StepCachePolicy(threshold=0.55, max_reuse_in_a_row=2),
    }

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, min_images=1, max_images=1)

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        return image_to_video_size(params, self.config.image_to_video_area, self.pixel_multiple)

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        return [
            WanImageToVideoPreparationStage(
                context.get("image_processor"),
                context.get("image_encoder"),
                context.get("vae"),
                spatial_factor=self.spatial,
                temporal_factor=self.temporal,
                output_dtype=context.dtype,
            )
        ]
