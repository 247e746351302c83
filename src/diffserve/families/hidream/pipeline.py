"""HiDream-I1 (Diffusers `HiDreamImagePipeline`): two CLIP encoders (pooled), T5 and every layer of a Llama
decoder (`text_encoding.py`), the MoE DiT (`models/dits/hidream_image.py`) on FLUX.1's 16-channel VAE
latents (unpacked: the DiT patchifies them), the folder's flow-matching Euler or UniPC steps, classic CFG.

Every request's prompt and negative-prompt branches go through one DiT forward; requests at different steps
share it (each row has its own timestep). As in Diffusers: the DiT's output is negated into the velocity the
scheduler steps with, CFG is `uncond + scale * (cond - uncond)` when guidance_scale > 1 (the negative prompt
defaulting to ""), and the output size follows Diffusers' area rule (`stages.py`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.cache_settings import TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.families.hidream.conditioning import HiDreamConditioning
from diffserve.families.hidream.config import HiDreamPipelineConfig, hidream_default_sampling_params
from diffserve.families.hidream.stages import (
    HiDreamInputValidationStage,
    HiDreamTimestepPreparationStage,
    check_unipc_shift,
)
from diffserve.families.hidream.text_encoding import HiDreamTextEncodingStage
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.hidream_image import HiDreamImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, gather_branches, split_guided, step_cache_for
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule
from diffserve.stages.latent_preparation import SpatialLatentPreparationStage


def branch_llama_states(req: Req) -> list[torch.Tensor]:
    """The request's Llama states per branch, in `gather_branches` row order."""
    conditioning = HiDreamConditioning.of(req)
    if req.do_cfg:
        return [conditioning.llama_states, conditioning.negative_llama_states]
    return [conditioning.llama_states]


class HiDreamDenoiser:
    """One step over a list of HiDream requests of one latent shape and text length, each at its own
    timestep, as one DiT batch."""

    def __init__(
        self,
        transformer: HiDreamImageTransformer2DModel,
        scheduler: FlowMatchEulerScheduler | UniPCFlowScheduler,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        llama = [states for req in reqs for states in branch_llama_states(req)]
        prediction = self.transformer(
            hidden_states=torch.cat(batch.latents),
            timesteps=torch.cat(batch.timesteps),  # already on the latents' device
            encoder_hidden_states_t5=torch.cat(batch.text),
            encoder_hidden_states_llama3=torch.cat(llama, dim=1),
            pooled_embeds=torch.cat(batch.pooled),
            step_cache=step_cache_for(reqs),  # rows in `gather_branches` order, as it expects
        )
        advance_requests(self.scheduler, reqs, split_guided(-prediction, reqs))


class HiDreamPipeline(Pipeline):
    required_components = (
        "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3",
        "text_encoder_4", "tokenizer_4", "vae", "transformer", "scheduler",
    )  # fmt: skip
    config = HiDreamPipelineConfig()
    pipeline_name = "HiDreamImagePipeline"
    conditioning_type = HiDreamConditioning
    #: Measured on the tiny random-weight test model (`build_tiny_hidream`, 20 steps, 32x32 asked for, 128x128
    #: by the area rule, CFG 5, the four built-in prompts of `diffserve calibrate-cache`, 1 dB margin, every
    #: preset also holding its bar at 4 and 8 steps): TeaCache (the raw change: the family has no published
    #: coefficients) at 0.8, 4.8 and 6.4, 16, 6 and 4 DiT blocks of 40 at 43.7, 35.1 and 32.6 dB (8, 3 and 2
    #: of 20 steps in full; at 4 steps 41.6, 30.4 and 30.4 dB). `calibrate-cache` picks TeaCache at 6.4 for
    #: low too; low takes 4.8 so that draft computes fewer steps. The tiny DiT's residual changes little
    #: between steps; real checkpoints move differently: calibrate them.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": TeaCacheSettings(rel_l1_thresh=0.8),
        "low": TeaCacheSettings(rel_l1_thresh=4.8),
        "draft": TeaCacheSettings(rel_l1_thresh=6.4),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        dit = transformer.config
        check_unipc_shift(scheduler)
        vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = vae_scale_factor * dit.patch_size
        self.input_validation = HiDreamInputValidationStage(
            vae_scale_factor=vae_scale_factor,
            default_sample_size=self.config.default_sample_size,
            min_max_sequence_length=self.config.min_max_sequence_length,
            max_patches=transformer.max_seq,
            defaults=apply_overrides(hidream_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_sample_size * vae_scale_factor,
            max_sequence_length_limit=None,
            cfg_mode="classic",
            image_inputs=ImageInputRule(pipeline_name=self.pipeline_name),
            unsupported_params={
                "true_cfg_scale": "HiDream-I1 runs classic CFG, set by guidance_scale (> 1 turns it on)",
            },
        )
        self.denoiser = HiDreamDenoiser(transformer, scheduler)
        device, dtype = context.platform.device(), context.dtype
        return [
            self.input_validation,
            HiDreamTextEncodingStage(
                (context.get("tokenizer"), context.get("tokenizer_2")),
                (context.get("text_encoder"), context.get("text_encoder_2")),
                context.get("tokenizer_3"),
                context.get("text_encoder_3"),
                context.get("tokenizer_4"),
                context.get("text_encoder_4"),
                clip_max_length=self.config.clip_max_length,
                output_dtype=dtype,
            ),
            SpatialLatentPreparationStage(
                latent_channels=dit.in_channels, vae_scale_factor=vae_scale_factor, device=device, dtype=dtype
            ),
            HiDreamTimestepPreparationStage(scheduler, transformer.max_seq, self.config),
            DenoisingStage(self.denoiser),
            DecodingStage(vae, packed_latents=False),
        ]

    def batch_key(self, req: Req) -> tuple:
        """The shared key, plus the Llama states' layers, length and width (a request's own shape)."""
        llama = HiDreamConditioning.of(req).llama_states
        assert llama is not None
        return (*super().batch_key(req), (llama.shape[0], *llama.shape[2:]))
