"""Wan 2.1 and 2.2 (Diffusers `WanPipeline`, `WanImageToVideoPipeline`): stages and the batched
denoising step.

Classic CFG as in Diffusers (`uncond + scale * (cond - uncond)` when guidance_scale > 1), but the two
branches of every request share one DiT forward. Image-to-video adds the first-frame conditioning
latents on the channel axis and (Wan 2.1) the CLIP image tokens for the DiT's image cross-attention.

Wan 2.2 folders keep these class names and say what they are in model_index.json:
- A14B (`boundary_ratio`, `transformer_2`): two experts split the schedule (`wan_experts.py`); requests
  on different experts never share a DiT batch (the expert is part of the batch key, and the denoiser
  splits a mixed list too).
- TI2V-5B (`expand_timesteps`, Wan 2.2's VAE): every patch token carries its own timestep. One folder
  makes text-to-video and, given an input image, image-to-video: the image's latents replace the first
  latent frame, whose tokens run at timestep 0.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import torch

from diffserve.configs.cache_settings import EasyCacheSettings, TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import ModelLoadError
from diffserve.families.wan.conditioning import WanConditioning
from diffserve.families.wan.config import WanPipelineConfig, wan_default_sampling_params
from diffserve.families.wan.experts import HIGH_NOISE, ExpertSwitch, guidance_scale_of
from diffserve.families.wan.folder_checks import (
    check_image_encoder,
    check_vae_scale_factors,
    refuse_no_temporal_compression,
)
from diffserve.families.wan.image_to_video_preparation import (
    WanImageToVideoPreparationStage,
    image_to_video_size,
)
from diffserve.families.wan.last_image import (
    WanImageToVideoValidationStage,
    image_input_rule,
    last_image_use,
)
from diffserve.families.wan.text_encoding import WanTextEncodingStage
from diffserve.families.wan.ti2v_preparation import WanFirstFrameLatentStage
from diffserve.layers.lora_rows import request_lora_scope
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu
from diffserve.models.dits.wan import EmbeddedContext, WanTransformer3DModel
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import (
    advance_requests,
    branch_texts,
    classic_cfg,
    split_guided,
    step_cache_for,
)
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage, VideoRule
from diffserve.stages.latent_preparation import VideoLatentPreparationStage
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage
from diffserve.stages.video_vae_decoding import VideoVaeDecodingStage


class ExpertContext(NamedTuple):
    """A request's embedded cross-attention context and the expert whose embedders made it."""

    expert: int
    context: EmbeddedContext


class WanDenoiser:
    """One step over a list of Wan requests of one latent shape, each at its own timestep.

    `transformers`: the DiT, or A14B's two experts (high-noise first) with the `switch` that picks one
    per step. `expand_timesteps` (Wan 2.2 TI2V): per-token timesteps, and a request's
    `WanConditioning.condition_latents` are its first latent frame rather than extra channels.
    """

    def __init__(
        self,
        transformers: tuple[WanTransformer3DModel, ...],
        scheduler,
        switch: ExpertSwitch | None = None,
        expand_timesteps: bool = False,
    ) -> None:
        if (switch is None) != (len(transformers) == 1):
            raise ValueError("a second expert needs an ExpertSwitch, and an ExpertSwitch a second expert")
        self.transformers = transformers
        self.scheduler = scheduler
        self.switch = switch
        self.expand_timesteps = expand_timesteps
        self.patch = transformers[0].config.patch_size
        self.dtype = next(transformers[0].parameters()).dtype

    @property
    def transformer(self) -> WanTransformer3DModel:
        """The DiT: the only one, or A14B's high-noise expert (`transformers[0]`)."""
        return self.transformers[0]

    def expert_of(self, req: Req) -> int:
        """The expert (index into `transformers`) of the request's next step."""
        return HIGH_NOISE if self.switch is None else self.switch.expert(req)

    def context_for(self, req: Req, expert: int) -> EmbeddedContext:
        """The request's cross-attention context (text, and the CLIP image states for Wan 2.1 I2V, of each
        CFG branch) through the expert's embedders, once per request and expert: no step changes them,
        and the text embedder alone is an MLP over 512 tokens per branch."""
        cached = req.dit_context
        if not (isinstance(cached, ExpertContext) and cached.expert == expert):
            texts = branch_texts(req)
            image_embeds = WanConditioning.of(req).image_embeds
            images = [image_embeds] * len(texts) if image_embeds is not None else None
            with request_lora_scope(req.loras):
                context = self.transformers[expert].embed_context(
                    torch.cat(texts), torch.cat(images) if images else None
                )
            req.dit_context = cached = ExpertContext(expert, context)  # the other expert's is dropped
        return cached.context

    def model_input(self, req: Req) -> torch.Tensor:
        """The DiT's input latents: the noisy ones, with the conditioning (I2V) concatenated on channels,
        or (TI2V) in place of the first frame."""
        cond = WanConditioning.of(req).condition_latents
        if cond is None:
            return req.latents
        if self.expand_timesteps:
            return torch.cat([cond, req.latents[:, :, 1:]], dim=2)
        return torch.cat([req.latents, cond], dim=1)

    def timestep_rows(self, req: Req) -> torch.Tensor:
        """(batch,) step timesteps, or with `expand_timesteps` (batch, tokens): the first frame's tokens
        at 0 when the image conditions it, as Diffusers' first-frame mask times t."""
        t = req.schedule.timesteps[req.step_index]
        if not self.expand_timesteps:
            return t.expand(req.batch_size)
        frames, height, width = req.latents.shape[2:]
        p_t, p_h, p_w = self.patch
        grid = t.expand(frames // p_t, height // p_h, width // p_w)
        if WanConditioning.of(req).condition_latents is not None:
            grid = torch.cat([torch.zeros_like(grid[:1]), grid[1:]])
        return grid.reshape(1, -1).expand(req.batch_size, -1)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        by_expert: dict[int, list[Req]] = {}
        for req in reqs:  # every expert chosen before any request advances
            by_expert.setdefault(self.expert_of(req), []).append(req)
        for expert in sorted(by_expert):
            self._step(expert, by_expert[expert])

    def _step(self, expert: int, reqs: list[Req]) -> None:
        # Rows in `cfg_batch` order (per request: positive rows, then negative ones), which is what
        # `step_cache_for` and `split_guided` expect.
        latents, timesteps = [], []
        for req in reqs:
            model_input, t = self.model_input(req), self.timestep_rows(req)
            for _branch in range(2 if req.do_cfg else 1):
                latents.append(model_input)
                timesteps.append(t)
        contexts = [self.context_for(req, expert) for req in reqs]
        prediction = self.transformers[expert](
            hidden_states=torch.cat(latents).to(self.dtype),
            timestep=torch.cat(timesteps),  # already on the latents' device
            encoder_hidden_states=None,
            context=EmbeddedContext(torch.cat([c.states for c in contexts]), contexts[0].image_len),
            step_cache=step_cache_for(reqs),
            **self.extra_dit_inputs(reqs),
        )
        advance_requests(self.scheduler, reqs, self._guided(prediction.float(), reqs, expert))
        if self.expand_timesteps:
            for req in reqs:
                if req.is_denoised and WanConditioning.of(req).condition_latents is not None:
                    # As Diffusers after its loop: the image's latents are the clip's first frame.
                    req.latents = self.model_input(req)

    def extra_dit_inputs(self, reqs: list[Req]) -> dict[str, Any]:
        """DiT keywords beyond Wan's, for the rows of `reqs` (none for Wan)."""
        return {}

    @staticmethod
    def _guided(prediction: torch.Tensor, reqs: list[Req], expert: int) -> list[torch.Tensor]:
        """Each request's guided prediction at its scale for `expert` (`guidance_scale_of`)."""
        if expert == HIGH_NOISE:
            return split_guided(prediction, reqs)
        out, offset = [], 0
        for req in reqs:
            rows = req.batch_size * (2 if req.do_cfg else 1)
            scale = guidance_scale_of(req, expert)
            out += split_guided(
                prediction[offset : offset + rows],
                [req],
                lambda positive, negative, _scale, scale=scale: classic_cfg(positive, negative, scale),
            )
            offset += rows
        return out


class WanPipeline(Pipeline):
    #: cache-dit runs its DBCache with the CFG branch apart for this pipeline (`enable_separate_cfg`).
    cache_separate_cfg = True
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    #: Wan 2.2 A14B's low-noise expert (with `boundary_ratio` in model_index.json).
    optional_components: tuple[str, ...] = ("transformer_2",)
    #: Diffusers' Wan pipelines size the latents by the VAE config's `scale_factor_spatial` /
    #: `scale_factor_temporal` (`check_vae_scale_factors`); SkyReels-V2's derive them from the network.
    latent_size_from_vae_config: ClassVar[bool] = True
    config = WanPipelineConfig()
    pipeline_name = "WanPipeline"
    conditioning_type = WanConditioning
    denoiser_cls: ClassVar[type[WanDenoiser]] = WanDenoiser
    input_validation_cls: ClassVar[type[InputValidationStage]] = InputValidationStage
    #: Chosen by `diffserve calibrate-cache` on the tiny random-weight T2V test model (`build_tiny_wan`, 20
    #: steps, 64x64, 9 frames, CFG 5, the four built-in prompts, 1 dB margin, every candidate also holding
    #: the bar at 4 and 8 steps), a preset replacing the former step-cache threshold only where it computes
    #: fewer DiT blocks: medium the step cache, 38.5 blocks of 40 (identical pixels); low TeaCache 30 at
    #: 34.5 dB (the step cache: 32 at 35.1 dB); draft the step cache at 0.8, 25 at 28.0 dB (at 0.75: 26 at
    #: 28.4 dB). Its signal moves 0.45-0.9 a step and its blocks' residual about as much as it is large, so
    #: reuse is costly on it. Real checkpoints move differently: calibrate them. (Wan 2.2 A14B folders serve
    #: "high" only: a reused residual would cross the switch between the experts.)
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": StepCachePolicy(threshold=0.45, max_reuse_in_a_row=1),
        "low": TeaCacheSettings(rel_l1_thresh=0.6),
        "draft": StepCachePolicy(threshold=0.8, max_reuse_in_a_row=2),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        options = context.pipeline_options
        self.expand_timesteps = bool(options.get("expand_timesteps", False))
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        self.dit_config = transformer.config
        refuse_dynamic_shifting_without_mu(scheduler, self.pipeline_name)
        refuse_no_temporal_compression(vae)
        if self.latent_size_from_vae_config:
            check_vae_scale_factors(vae)
        switch = self.expert_switch(context, transformer.config.patch_size[1])
        transformers = (transformer,) if switch is None else (transformer, context.get("transformer_2"))
        if switch is not None:
            self.step_cache_policies = {}
        self.denoiser = self.denoiser_cls(transformers, scheduler, switch, self.expand_timesteps)
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = self.spatial * transformer.config.patch_size[1]
        unsupported = {"true_cfg_scale": "Wan runs classic CFG, set by guidance_scale (> 1 turns it on)"}
        if switch is None:
            unsupported["guidance_scale_2"] = (
                "it is the low-noise expert's CFG scale of Wan 2.2 A14B folders (boundary_ratio in "
                "model_index.json); this folder has one DiT"
            )
        defaults = self.default_sampling_params()
        if self.expand_timesteps:
            defaults = apply_overrides(defaults, {"fps": self.config.ti2v_fps})
        self.input_validation = self.input_validation_cls(
            defaults=apply_overrides(defaults, context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_height,
            max_sequence_length_limit=self.config.max_sequence_length_limit,
            cfg_mode="classic",
            image_inputs=self.image_input_rule(),
            default_size=self.default_size,
            unsupported_params=unsupported,
            video=VideoRule(temporal_factor=self.temporal),
            expert_guidance=switch is not None,
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
            DenoisingStage(self.denoiser),
            VideoVaeDecodingStage(vae),
        ]

    @staticmethod
    def expert_switch(context: PipelineContext, patch_size: int) -> ExpertSwitch | None:
        """Wan 2.2 A14B's switch between its experts, or None for a one-DiT folder."""
        boundary_ratio = context.pipeline_options.get("boundary_ratio")
        has_second = context.get_optional("transformer_2") is not None
        if boundary_ratio is None and not has_second:
            return None
        if boundary_ratio is None or not has_second:
            raise ModelLoadError(
                "model_index.json sets boundary_ratio without transformer_2, or transformer_2 without "
                "boundary_ratio: Wan 2.2 A14B folders need both (the low-noise expert and where it takes over)"
            )
        if isinstance(boundary_ratio, bool) or not isinstance(boundary_ratio, int | float):
            raise ModelLoadError(f"model_index.json: boundary_ratio must be a number, got {boundary_ratio!r}")
        if not math.isfinite(boundary_ratio):
            raise ModelLoadError(f"model_index.json: boundary_ratio must be finite, got {boundary_ratio!r}")
        # Any value runs as in Diffusers: at or below 0 every step is the high-noise expert's, above 1 none is.
        return ExpertSwitch(context.get("scheduler"), patch_size, float(boundary_ratio))

    def batch_key(self, req: Req) -> tuple:
        """The base key plus the expert of the request's next step (evaluated at every step)."""
        return (*super().batch_key(req), self.denoiser.expert_of(req))

    @staticmethod
    def default_sampling_params() -> SamplingParams:
        """Diffusers' `__call__` defaults of the pipeline this class serves."""
        return wan_default_sampling_params()

    def image_input_rule(self) -> ImageInputRule:
        if self.expand_timesteps:  # Wan 2.2 TI2V: text-to-video, or image-to-video with one image
            return ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video", max_images=1)
        return ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video")

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        if params.input_images:
            return image_to_video_size(params, self.config.image_to_video_area, self.pixel_multiple)
        return self.config.default_height, self.config.default_width

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        return [WanFirstFrameLatentStage(context.get("vae"))] if self.expand_timesteps else []


class WanImageToVideoPipeline(WanPipeline):
    """Animates one input image; the output keeps its aspect ratio unless height/width are given. A second
    input image is the last frame (Diffusers' `last_image`) where the DiT takes one (`last_image.py`):
    required by FLF2V, optional without image cross-attention (Wan 2.2 A14B).

    The CLIP image encoder is used (and needed) only by DiTs with image cross-attention (Wan 2.1's
    `image_dim`); Wan 2.2 A14B's folders set it to null, as Diffusers allows."""

    optional_components = (*WanPipeline.optional_components, "image_encoder", "image_processor")
    pipeline_name = "WanImageToVideoPipeline"
    input_validation_cls: ClassVar[type[InputValidationStage]] = WanImageToVideoValidationStage
    #: Chosen like WanPipeline's on the tiny I2V test model (64x64 input image): medium and low the step
    #: cache (38 / 35 blocks of 40 at 46.4 / 36.4 dB; no candidate computes fewer at those bars), draft
    #: EasyCache 24 blocks at 29.1 dB (the step cache at 0.55: 30 at 28.4 dB). Reuse costs more here than in
    #: T2V.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": StepCachePolicy(threshold=0.45, max_reuse_in_a_row=1),
        "low": StepCachePolicy(threshold=0.5, max_reuse_in_a_row=2),
        "draft": EasyCacheSettings(reuse_threshold=1.2),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        stages = super().build_stages(context)
        validation = self.input_validation
        assert isinstance(validation, WanImageToVideoValidationStage)
        validation.last_image = last_image_use(self.dit_config, self.expand_timesteps)
        return stages

    def image_input_rule(self) -> ImageInputRule:
        use = last_image_use(self.dit_config, self.expand_timesteps)
        return image_input_rule(self.pipeline_name, use)

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        return image_to_video_size(params, self.config.image_to_video_area, self.pixel_multiple)

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        if self.expand_timesteps:
            return [WanFirstFrameLatentStage(context.get("vae"))]
        image_encoder = None
        dit = context.get("transformer").config
        if dit.image_dim is not None:
            missing = [n for n in ("image_encoder", "image_processor") if context.get_optional(n) is None]
            if missing:
                raise ModelLoadError(
                    f"this image-to-video DiT cross-attends to CLIP image states (image_dim is set), but "
                    f"model_index.json has no {' or '.join(missing)}"
                )
            image_encoder = context.get("image_encoder")
            check_image_encoder(image_encoder, dit.image_dim, dit.pos_embed_seq_len)
        elif context.get_optional("image_encoder") is not None:
            raise ModelLoadError(
                "model_index.json names an image_encoder, but the DiT takes no image states (image_dim is "
                "null, as in Wan 2.2 A14B); set image_encoder and image_processor to null"
            )
        return [
            WanImageToVideoPreparationStage(
                context.get_optional("image_processor"),
                image_encoder,
                context.get("vae"),
                spatial_factor=self.spatial,
                temporal_factor=self.temporal,
                output_dtype=context.dtype,
            )
        ]
