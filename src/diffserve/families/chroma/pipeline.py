"""Chroma (Diffusers `ChromaPipeline`): T5 text with its padding masked, FLUX.1's latents, timesteps and
VAE, classic CFG (on when guidance_scale > 1; the negative prompt defaults to ""), and the Chroma DiT; with
an input image, image-to-image from the same folder (Diffusers' `ChromaImg2ImgPipeline`), and with a mask
too, inpainting (`ChromaInpaintPipeline`).

Every request's prompt and negative-prompt branches go through ONE DiT forward (Diffusers runs two): each
row carries its own text mask, so requests and branches with different prompt lengths share a batch."""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.cache_settings import TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import ModelLoadError
from diffserve.families.chroma.conditioning import ChromaConditioning
from diffserve.families.chroma.config import ChromaPipelineConfig, chroma_default_sampling_params
from diffserve.families.chroma.text_encoding import ChromaTextEncodingStage
from diffserve.layers.rotary import RopeTables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.chroma import ChromaTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import (
    advance_requests,
    embedded_context,
    gather_branches,
    split_guided,
    step_cache_for,
)
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.image_to_image import ImageToImageNoisingStage, InputImageEncodingStage
from diffserve.stages.input_validation import one_image_input_validation
from diffserve.stages.latent_preparation import PackedLatentIdsPreparationStage, pack_latents
from diffserve.stages.mask_preparation import InpaintMaskStage
from diffserve.stages.packed_ids_rope import packed_ids_rope
from diffserve.stages.timestep_preparation import TimestepPreparationStage


class ChromaLatentPreparationStage(PackedLatentIdsPreparationStage):
    conditioning_type = ChromaConditioning


class ChromaDenoiser:
    """One denoising step over a list of Chroma requests, each at its own timestep, as one DiT batch (a
    request with CFG contributes both branches). Requests in one call share the latent grid and the text
    length (the batch key); their text masks may differ."""

    def __init__(self, transformer: ChromaTransformer2DModel, scheduler: FlowMatchEulerScheduler) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        #: RoPE tables per request shape (least recently used evicted).
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache()

    def rope_for(self, req: Req) -> RopeTables:
        """RoPE tables for the request's shape (text ids are zeros, image ids the packed grid), once per shape."""
        ids = ChromaConditioning.of(req)
        return packed_ids_rope(self._rope_cache, self.transformer, req, ids.text_ids, ids.image_ids)

    def context_for(self, req: Req) -> torch.Tensor:
        """The request's text branches through the DiT's context embedder, once per request."""
        return embedded_context(self.transformer, req)

    @staticmethod
    def text_masks(req: Req) -> torch.Tensor:
        """The request's text masks in row order: the prompt's, then the negative prompt's with CFG."""
        conditioning = ChromaConditioning.of(req)
        if req.do_cfg:
            return torch.cat([conditioning.text_mask, conditioning.negative_text_mask])
        return conditioning.text_mask

    @staticmethod
    def dit_timesteps(reqs: list[Req], timesteps: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Each row's sigma (timestep / 1000) as Diffusers rounds it: ChromaPipeline and
        ChromaInpaintPipeline round the timestep to the latents' dtype before dividing,
        ChromaImg2ImgPipeline divides the float32 timestep (the DiT then rounds both to its dtype; in
        float32 they are the same)."""
        rows = iter(timesteps)
        out = []
        for req in reqs:
            for _ in range(2 if req.do_cfg else 1):
                t = next(rows)
                image_to_image = req.params.input_images and req.params.mask_image is None
                out.append(t if image_to_image else t.to(dtype).float())
        return torch.cat(out) / 1000

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        first = reqs[0]
        conditioning = ChromaConditioning.of(first)
        # Timesteps are already on the latents' device (timestep preparation put them there).
        prediction = self.transformer(
            hidden_states=torch.cat(batch.latents),
            encoder_hidden_states=None,
            context=torch.cat([self.context_for(r) for r in reqs]),
            timestep=self.dit_timesteps(reqs, batch.timesteps, first.latents.dtype),
            img_ids=conditioning.image_ids,
            txt_ids=conditioning.text_ids,
            text_mask=torch.cat([self.text_masks(r) for r in reqs]),
            rope=self.rope_for(first),
            step_cache=step_cache_for(reqs),
        )
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))


class ChromaPipeline(Pipeline):
    """Chroma text-to-image; image-to-image with one input image noised by `strength` (0.9 by default,
    as Diffusers' `ChromaImg2ImgPipeline`), and inpainting with a mask too (0.6 by default, as
    `ChromaInpaintPipeline`; the folder's step, guidance and text-length defaults stay ChromaPipeline's)."""

    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = ChromaPipelineConfig()
    conditioning_type: ClassVar[type[ChromaConditioning]] = ChromaConditioning
    #: Measured on the tiny random-weight test model (`build_tiny_chroma`, 20 steps, 64x64, CFG 5, the four
    #: built-in prompts of `diffserve calibrate-cache`, 1 dB margin, every preset also holding its bar at 4
    #: and 8 steps): medium and low as `calibrate-cache` chose them, the step cache at 0.8 and 1.6, 18 and 15
    #: DiT blocks of 60 at 39.9 and 35.9 dB (6 and 5 of 20 steps in full); draft TeaCache at 1.6, 9 blocks at
    #: 32.7 dB (3 steps; 28.4 dB at 8 steps). `calibrate-cache` picks TeaCache at 6.4 for draft, 6 blocks at
    #: 27.1 dB, but on other prompts that keeps 25.8 dB: too close to the bar. The tiny DiT's residual changes
    #: little between steps; real checkpoints move differently: calibrate them.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": StepCachePolicy(threshold=0.8, max_reuse_in_a_row=5),
        "low": StepCachePolicy(threshold=1.6, max_reuse_in_a_row=5),
        "draft": TeaCacheSettings(rel_l1_thresh=1.6),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * self.config.latent_patch_size
        device, dtype = context.platform.device(), context.dtype
        default_pixels = self.config.default_sample_size * self.vae_scale_factor
        latent_channels = int(vae.config["latent_channels"])
        try:
            transformer.check_packed_latents(latent_channels)
        except ValueError as exc:
            raise ModelLoadError(f"ChromaPipeline: {exc}") from exc
        self.input_validation = one_image_input_validation(
            "ChromaPipeline",
            defaults=apply_overrides(chroma_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=default_pixels,
            max_sequence_length_limit=self.config.max_t5_sequence_length,
            default_strength=self.config.default_strength,
            default_inpaint_strength=self.config.default_inpaint_strength,
            unsupported_params={
                "true_cfg_scale": "Chroma's CFG is set by guidance_scale (> 1 turns it on, with negative_prompt)"
            },
            cfg_mode="classic",
        )
        self.denoiser = ChromaDenoiser(transformer, scheduler)
        return [
            self.input_validation,
            ChromaTextEncodingStage(
                context.get("tokenizer"), context.get("text_encoder"), output_dtype=dtype
            ),
            # Image-to-image: the input image's latents are the generator's first draw, as in Diffusers.
            InputImageEncodingStage(vae, pack_latents, device=device, dtype=dtype),
            ChromaLatentPreparationStage(
                latent_channels=latent_channels,
                vae_scale_factor=self.vae_scale_factor,
                device=device,
                dtype=dtype,
            ),
            TimestepPreparationStage(scheduler, guidance_embeds=False),
            ImageToImageNoisingStage(),
            InpaintMaskStage(latent_channels, pack_latents),
            DenoisingStage(self.denoiser),
            DecodingStage(vae),
        ]
