"""CogVideoX 1.0 / 1.5 (Diffusers `CogVideoXPipeline`, `CogVideoXImageToVideoPipeline`): T5 text, the joint
text-video DiT (`models/dits/cogvideox.py`) on CogVideoX's causal VAE latents, the DDIM or DPM sampler the
folder names (`models/schedulers/cogvideox_ddim.py`), classic CFG.

Every request's prompt and negative-prompt branches go through one DiT forward; requests at different
steps share it (each row has its own timestep); under CFG parallelism each rank runs one branch and
`split_guided` joins them. CFG is Diffusers' `uncond + scale * (cond - uncond)` when
guidance_scale > 1; with `use_dynamic_cfg` (a request setting in `SamplingParams.extra`) the scale of the
step at timestep t of n steps is `1 + guidance_scale * (1 - cos(pi * ((n - t) / n) ** 5)) / 2`, as Diffusers
computes it. The latents stay in the model's dtype between steps, as in Diffusers; the DPM sampler draws its
noise from the request's generator. Image-to-video concatenates the input image's latents (then zero
frames) to the noisy latents on channels, and the 1.5 I2V DiT embeds Diffusers' `ofs` of 2.

Deliberately unlike Diffusers: its CogVideoX pipelines set `num_videos_per_prompt` to 1 whatever the caller
passes; here `num_outputs_per_prompt` makes that many videos, their noise drawn together from the request's
generator (as Diffusers draws a batch), so the first is Diffusers' one video with DDIM but not with the DPM
sampler, whose per-step noise is drawn for the whole batch. Sizes the DiT's positions do not cover (1.5: above
the sample size; 1.0-5B-I2V: other than it) and a text length other than the one its added positions need are
refused when the request is validated (`CogVideoXInputValidationStage`), where Diffusers fails in its DiT.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from PIL import Image

from diffserve.configs.cache_settings import DBCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.errors import ModelLoadError
from diffserve.families.cogvideox.conditioning import CogVideoXConditioning
from diffserve.families.cogvideox.config import (
    CogVideoXPipelineConfig,
    cogvideox_default_sampling_params,
    cogvideox_settings,
)
from diffserve.families.cogvideox.stages import (
    CogVideoXDecodingStage,
    CogVideoXInputValidationStage,
    CogVideoXLatentPreparationStage,
    CogVideoXTextEncodingStage,
    CogVideoXTimestepPreparationStage,
    to_diffusers_layout,
)
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel, CogVideoXTransformerConfig
from diffserve.models.schedulers.cogvideox_ddim import CogVideoXDPMScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import branch_texts, classic_cfg, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import tensor_to_pil
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, VideoRule
from diffserve.stages.previews import pool_factor


def dynamic_cfg_scale(guidance_scale: float, timestep: int, num_steps: int) -> float:
    """Diffusers' `use_dynamic_cfg` scale at `timestep` (an integer in [0, num_train_timesteps))."""
    return 1 + guidance_scale * ((1 - math.cos(math.pi * ((num_steps - timestep) / num_steps) ** 5.0)) / 2)


class CogVideoXDenoiser:
    """One step over a list of CogVideoX requests of one latent shape, each at its own timestep."""

    def __init__(
        self, transformer: CogVideoXTransformer3DModel, scheduler, dtype: torch.dtype, ofs: float
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.dtype = dtype
        self.ofs = ofs if transformer.config.ofs_embed_dim else None
        self.stochastic = isinstance(scheduler, CogVideoXDPMScheduler)

    def model_input(self, req: Req) -> torch.Tensor:
        """The DiT's input in Diffusers' layout: the noisy latents, with I2V's image latents on channels."""
        x = to_diffusers_layout(req.latents)
        image = CogVideoXConditioning.of(req).image_latents
        return x if image is None else torch.cat([x, image.to(x.dtype)], dim=2)

    def guidance_scale(self, req: Req) -> float:
        scale = req.cfg_scale
        if cogvideox_settings(req.params).use_dynamic_cfg:
            timesteps = CogVideoXConditioning.of(req).host_timesteps
            scale = dynamic_cfg_scale(
                req.params.guidance_scale, int(timesteps[req.step_index]), len(timesteps)
            )
        return scale

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        inputs, texts, timesteps = [], [], []
        for req in reqs:
            x = self.model_input(req)
            t = req.schedule.timesteps[req.step_index]
            for text in branch_texts(req):
                inputs.append(x)
                texts.append(text)
                timesteps.append(t.expand(req.batch_size))
        timestep = torch.cat(timesteps)
        ofs = None
        if self.ofs is not None:  # one per row (Diffusers embeds one and broadcasts it): a row's LoRA
            # adapters (layers/lora_rows.py) reach its own ofs embedding
            ofs = torch.full(timestep.shape, self.ofs, dtype=self.dtype, device=inputs[0].device)
        prediction = self.transformer(
            hidden_states=torch.cat(inputs).to(self.dtype),
            encoder_hidden_states=torch.cat(texts).to(self.dtype),
            timestep=timestep,
            ofs=ofs,
            step_cache=step_cache_for(reqs),  # rows: each request's branches in turn, as it expects
        ).float()
        offset = 0
        for req in reqs:  # one request at a time: a CFG scale of its own at each step (use_dynamic_cfg)
            rows = req.batch_size * (2 if req.do_cfg else 1)
            scale = self.guidance_scale(req)
            (guided,) = split_guided(
                prediction[offset : offset + rows],
                [req],
                lambda positive, negative, _scale, scale=scale: classic_cfg(positive, negative, scale),
            )
            offset += rows
            self._advance(req, to_diffusers_layout(guided))

    def _advance(self, req: Req, noise_pred: torch.Tensor) -> None:
        if req.step_index == 0 and req.scheduler_state is None:
            req.scheduler_state = self.scheduler.new_state()
        req.last_prediction = noise_pred
        timesteps = CogVideoXConditioning.of(req).host_timesteps
        if self.stochastic:
            latents = self.scheduler.step(
                noise_pred,
                req.latents,
                timesteps,
                req.step_index,
                req.scheduler_state,
                generator=req.generator,
                noise_shape=tuple(to_diffusers_layout(req.latents).shape),
                to_sample_layout=to_diffusers_layout,
            )
        else:
            latents = self.scheduler.step(
                noise_pred, req.latents, timesteps, req.step_index, req.scheduler_state
            )
        req.latents = latents.to(self.dtype)
        req.step_index += 1


class CogVideoXPipeline(Pipeline):
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = CogVideoXPipelineConfig()
    pipeline_name = "CogVideoXPipeline"
    conditioning_type = CogVideoXConditioning
    #: Measured on the tiny random-weight T2V test model (`build_tiny_cogvideox`, 20 steps, 32x32, 5 frames,
    #: CFG 6, the four built-in prompts of `diffserve calibrate-cache`, 1 dB margin): DBCache F1B0 reusing the
    #: last block from the second step on, at most 1, 4 and 6 steps in all, 39, 36 and 34 DiT blocks of 40 at
    #: 40.8, 32.2 and 27.6 dB (19, 16 and 14 of 20 steps in full). One step this tiny DiT reuses in full
    #: leaves 15.5 to 37.1 dB, by the step (the step cache and TeaCache reuse one at 28.0 dB;
    #: `calibrate-cache` finds nothing that reuses a step for medium or low), so the presets reuse part of a
    #: few early steps. They keep their bars at 20 steps only: at 8 steps the same number of reused steps is a
    #: larger share (33.2, 18.1 and 13.3 dB). Real checkpoints move differently, and at CogVideoX's 50 steps
    #: these caps reuse little: calibrate them (`diffserve calibrate-cache`). The image-to-video pipeline runs
    #: the same presets: on its tiny model (64x80, a gradient input image) they keep 59.2, 37.2 and 28.1 dB,
    #: where `calibrate-cache` finds nothing that reuses a step for medium and low either.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": DBCacheSettings(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=1,
            max_cached_steps=1, max_continuous_cached_steps=1,
        ),
        "low": DBCacheSettings(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=1,
            max_cached_steps=4, max_continuous_cached_steps=3,
        ),
        "draft": DBCacheSettings(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=1,
            max_cached_steps=6, max_continuous_cached_steps=3,
        ),
    }  # fmt: skip
    image_to_video = False

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        dit = transformer.config
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = self.spatial * dit.patch_size
        if dit.ofs_embed_dim and not self.image_to_video:
            raise ModelLoadError(
                f"{self.pipeline_name}: the DiT embeds an ofs value (ofs_embed_dim is set, as in CogVideoX 1.5 "
                "image-to-video), which only Diffusers' image-to-video pipeline passes (its text-to-video one "
                "fails); serve this folder as CogVideoXImageToVideoPipeline"
            )
        latent_channels = dit.in_channels // 2 if self.image_to_video else dit.in_channels
        if self.image_to_video and dit.in_channels % 2:
            raise ModelLoadError(
                f"{self.pipeline_name}: the DiT's in_channels ({dit.in_channels}) must be twice the latent "
                "channels (noise and image latents side by side)"
            )
        self.default_height = dit.sample_height * self.spatial
        self.default_width = dit.sample_width * self.spatial
        frames = self.config.image_to_video_frames if self.image_to_video else dit.sample_frames
        fps = self.config.fps_v10 if dit.patch_size_t is None else self.config.fps_v15
        self.input_validation = CogVideoXInputValidationStage(
            defaults=apply_overrides(
                cogvideox_default_sampling_params(frames, fps), context.folder_sampling_defaults
            ),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.default_height,
            max_sequence_length_limit=max(dit.max_text_seq_length, self.config.default_max_sequence_length),
            cfg_mode="classic",
            image_inputs=self.image_input_rule(),
            default_size=lambda _params: (self.default_height, self.default_width),
            unsupported_params={
                "true_cfg_scale": "CogVideoX runs classic CFG, set by guidance_scale (> 1 turns it on)",
            },
            video=VideoRule(temporal_factor=self.temporal),
            exact_text_length=dit.max_text_seq_length if dit.sincos_positions else None,
            exact_size=(self.default_height, self.default_width)
            if dit.use_learned_positional_embeddings
            else None,
            max_size=self.rope_grid_size(dit)
            if dit.use_rotary_positional_embeddings and dit.patch_size_t is not None
            else None,
        )
        return [
            self.input_validation,
            CogVideoXTextEncodingStage(
                context.get("tokenizer"), context.get("text_encoder"), output_dtype=context.dtype
            ),
            CogVideoXLatentPreparationStage(
                channels=latent_channels,
                spatial=self.spatial,
                temporal=self.temporal,
                patch_size_t=dit.patch_size_t,
                device=context.platform.device(),
                dtype=context.dtype,
                vae=vae if self.image_to_video else None,
            ),
            CogVideoXTimestepPreparationStage(scheduler),
            DenoisingStage(CogVideoXDenoiser(transformer, scheduler, context.dtype, self.config.ofs)),
            CogVideoXDecodingStage(vae),
        ]

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video")

    def rope_grid_size(self, dit: CogVideoXTransformerConfig) -> tuple[int, int]:
        """CogVideoX 1.5: the largest (height, width) in pixels its rotary positions cover, the sample size's
        whole patches (`rope_tables` refuses a larger patch grid, as Diffusers' DiT fails on one)."""
        step = dit.patch_size * self.spatial
        return (
            dit.sample_height // dit.patch_size * step,
            dit.sample_width // dit.patch_size * step,
        )

    @torch.inference_mode()
    def preview_images(self, req: Req) -> list[Image.Image]:
        """The first frame of the clean sample the sampler predicted at the request's last step, decoded
        (from latents pooled to `PREVIEW_MAX_PIXELS`, as the other families' previews)."""
        state = req.scheduler_state
        if req.step_index == 0 or state is None or state.pred_original_sample is None:
            raise ValueError(
                f"request {req.request_id} has not taken a denoising step yet: nothing to preview"
            )
        vae = self.decoding_stage.vae
        first = CogVideoXConditioning.of(req).padding_frames
        latents = state.pred_original_sample[:, :, first : first + 1]
        latents = (1 / float(vae.config["scaling_factor"])) * to_module(vae, latents)
        h, w = latents.shape[-2:]
        size = (h * self.spatial, w * self.spatial)
        s = pool_factor(*size)
        if s > 1:
            pooled = (max(1, round(h / s)), max(1, round(w / s)))
            flat = F.interpolate(latents.squeeze(2).float(), size=pooled, mode="area").to(latents.dtype)
            latents = flat.unsqueeze(2)
        rgb = vae.decode(latents)[:, :, 0]
        if tuple(rgb.shape[-2:]) != size:
            rgb = F.interpolate(rgb.float(), size=size, mode="bilinear", align_corners=False)
        return tensor_to_pil(rgb)


class CogVideoXImageToVideoPipeline(CogVideoXPipeline):
    """Animates one input image, resized to the requested (or default) size."""

    pipeline_name = "CogVideoXImageToVideoPipeline"
    image_to_video = True

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, min_images=1, max_images=1)
