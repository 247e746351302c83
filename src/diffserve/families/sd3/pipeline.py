"""Stable Diffusion 3 / 3.5 (Diffusers `StableDiffusion3Pipeline`): stages and the batched denoising step.

The same folder serves image-to-image and inpainting (Diffusers' `StableDiffusion3Img2ImgPipeline` and
`StableDiffusion3InpaintPipeline` with a 16-channel DiT): an optional input image noised by `strength`
(0.6 by default; 50 steps by default, as those pipelines) and an optional mask of the area to repaint."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import InvalidRequestError
from diffserve.families.sd3.config import SD3PipelineConfig, sd3_default_sampling_params
from diffserve.families.sd3.controlnet import (
    SD3Conditioning,
    SD3ControlImageEncodingStage,
    SD3ControlNetRunner,
)
from diffserve.families.sd3.text_encoding import SD3TextEncodingStage
from diffserve.families.sd3.validation import SD3InputValidationStage
from diffserve.layers.lora_rows import LoraRows, lora_rows_scope
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.controlnets.sd3 import SD3ControlNetModel
from diffserve.models.controlnets.sd3_single_stream import SD3SingleStreamControlNetModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import advance_requests, gather_branches, split_guided, step_cache_for
from diffserve.pipelines.controlnet_steps import check_controlnet_entries
from diffserve.request import Req
from diffserve.runtime.runner import CfgBranchView
from diffserve.stages.base import Stage
from diffserve.stages.decoding import DecodingStage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.image_to_image import ImageToImageNoisingStage, InputImageEncodingStage, spatial_latents
from diffserve.stages.input_validation import SkipLayerGuidanceRule, one_image_input_validation
from diffserve.stages.latent_preparation import SpatialLatentPreparationStage
from diffserve.stages.mask_preparation import InpaintMaskStage
from diffserve.stages.text_encoding import clip_context_length
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage


def skip_layer_guidance_now(req: Req) -> bool:
    """Whether `req`'s current step runs skip-layer guidance: it lists blocks to skip, runs CFG, and its
    step index lies strictly between `start` and `stop` times its step count (Diffusers' comparison, so
    the same steps are guided)."""
    p = req.params
    if not p.skip_guidance_layers:
        return False
    if isinstance(req, CfgBranchView):
        # Its two branches run on different cfg ranks; the correction needs the prompt's prediction on both.
        raise InvalidRequestError(
            "skip_guidance_layers is not supported with CFG parallelism (--cfg-parallel) yet",
            param="skip_guidance_layers",
        )
    if not req.do_cfg:
        return False
    steps, start, stop = req.num_steps, p.skip_layer_guidance_start, p.skip_layer_guidance_stop
    return steps * start < req.step_index < steps * stop


def prompt_row_offsets(reqs: list[Req]) -> list[int]:
    """Each request's first row in a batch built by `gather_branches` (its prompt rows come first)."""
    offsets, offset = [], 0
    for req in reqs:
        offsets.append(offset)
        offset += req.batch_size * (2 if req.do_cfg else 1)
    return offsets


class SD3Denoiser:
    """One step over a list of SD3 requests; classic CFG's two branches share the forward.

    Skip-layer guidance (SD3.5): a request within its guidance window adds
    `(prompt prediction - prediction with its blocks skipped) * skip_layer_guidance_scale` to its guided
    prediction, as Diffusers does. The skipped-block predictions take one extra forward per distinct set
    of skipped blocks in the step, over the prompt rows of the requests that skip them (every block runs
    exactly, without the step cache); a step with no such request runs as without the feature.
    """

    def __init__(
        self,
        transformer: SD3Transformer2DModel,
        scheduler: FlowMatchEulerScheduler,
        controlnets: dict[str, SD3ControlNetModel] | None = None,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        #: The engine's ControlNets by name (the pipeline's dict: loaded after the stages are built).
        self.controlnets = SD3ControlNetRunner({} if controlnets is None else controlnets)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        controls = self.controlnets.residuals(reqs) if self.controlnets.nets else []
        prediction = self.transformer(
            hidden_states=torch.cat(batch.latents),
            encoder_hidden_states=torch.cat(batch.text),
            pooled_projections=torch.cat(batch.pooled),
            timestep=torch.cat(batch.timesteps).to(reqs[0].latents.dtype),  # already on the latents' device
            step_cache=step_cache_for(reqs),
            **({"controlnet_residuals": controls} if controls else {}),
        )
        guided = split_guided(prediction, reqs)
        self._skip_layer_guidance(reqs, prediction, guided)
        advance_requests(self.scheduler, reqs, guided)

    def _skip_layer_guidance(
        self, reqs: list[Req], prediction: torch.Tensor, guided: list[torch.Tensor]
    ) -> None:
        """Add each guided request's skip-layer correction to its entry of `guided`, in place."""
        groups: dict[frozenset[int], list[int]] = {}
        for index, req in enumerate(reqs):
            if skip_layer_guidance_now(req):
                groups.setdefault(frozenset(req.params.skip_guidance_layers), []).append(index)
        if not groups:
            return
        offsets = prompt_row_offsets(reqs)
        for layers, members in groups.items():
            skipped = self._skipped_prediction([reqs[i] for i in members], layers)
            row = 0
            for i in members:
                n, scale = reqs[i].batch_size, reqs[i].params.skip_layer_guidance_scale
                text = prediction[offsets[i] : offsets[i] + n]
                guided[i] = guided[i] + (text - skipped[row : row + n]) * scale
                row += n

    def _skipped_prediction(self, members: list[Req], layers: frozenset[int]) -> torch.Tensor:
        """The prompt branch's prediction of every request in `members`, with `layers` skipped: one
        forward, in the requests' own LoRA rows."""
        row_loras = [req.loras for req in members for _ in range(req.batch_size)]
        lora_rows = LoraRows.for_rows(row_loras) if any(row_loras) else None
        with lora_rows_scope(lora_rows):
            return self.transformer(
                hidden_states=torch.cat([req.latents for req in members]),
                encoder_hidden_states=torch.cat([req.prompt_embeds for req in members]),
                pooled_projections=torch.cat([req.pooled_prompt_embeds for req in members]),
                timestep=torch.cat(
                    [req.schedule.timesteps[req.step_index].expand(req.batch_size) for req in members]
                ).to(members[0].latents.dtype),
                skip_layers=layers,
            )


class SD3Pipeline(Pipeline):
    required_components = (
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "vae",
        "transformer",
        "scheduler",
    )
    #: SD3 runs without T5 (its sequence part is then zeros, as in Diffusers), saving ~9 GB on the real model.
    optional_components = ("text_encoder_3", "tokenizer_3")
    config = SD3PipelineConfig()
    conditioning_type: ClassVar[type[SD3Conditioning]] = SD3Conditioning
    #: The ControlNet classes the engine may load for this pipeline by config `_class_name`
    #: (`loader/controlnets.py`).
    controlnet_classes: ClassVar[dict[str, type]] = {"SD3ControlNetModel": SD3ControlNetModel}
    #: FLUX's provisional values from before its calibration on the demo model: the tiny test model (20 steps, 64x64) clears every bar by 15+ dB with them (10 / 7 / 5
    #: steps in full for medium / low / draft) and does not tell thresholds apart (2 full steps still give
    #: 46 dB), so they stay as on the closest real family until `diffserve calibrate-cache` replaces them.
    step_cache_policies = {
        "medium": StepCachePolicy(threshold=0.1, max_reuse_in_a_row=2),
        "low": StepCachePolicy(threshold=0.25, max_reuse_in_a_row=3),
        "draft": StepCachePolicy(threshold=0.5, max_reuse_in_a_row=5),
    }

    def use_controlnets(self, nets: dict[str, SD3ControlNetModel | SD3SingleStreamControlNetModel]) -> None:
        """Serve `nets` by name from now on (requests name them in `controlnets`). Those without positions of
        their own (`use_pos_embed` false: SD3.5-Large's) take a copy of the DiT's patch embedding and position
        table, as Diffusers' pipeline gives them."""
        for net in nets.values():
            if net.needs_transformer_pos_embed:
                net.use_transformer_pos_embed(self.transformer_pos_embed)
        self.controlnets.update(nets)

    def _check_controlnets(self, params) -> None:
        check_controlnet_entries(params, self.controlnets, "StableDiffusion3Pipeline")
        if params.skip_guidance_layers:
            raise InvalidRequestError(
                "skip_guidance_layers with controlnets: Diffusers' StableDiffusion3ControlNetPipeline has no "
                "skip-layer guidance; leave one of them out",
                param="controlnets",
            )

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        patch = transformer.config.patch_size
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * patch
        default = transformer.config.sample_size * self.vae_scale_factor
        device, dtype = context.platform.device(), context.dtype
        table = transformer.config.pos_embed_max_size
        folder_defaults = context.folder_sampling_defaults
        image_defaults = apply_overrides(
            replace(sd3_default_sampling_params(), num_inference_steps=self.config.image_to_image_steps),
            folder_defaults,
        )
        self.input_validation = one_image_input_validation(
            "StableDiffusion3Pipeline",
            stage_cls=SD3InputValidationStage,
            defaults=apply_overrides(sd3_default_sampling_params(), folder_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=default,
            max_side=table * self.pixel_multiple if table else None,
            # Diffusers' img2img and inpainting pipelines' step default (the folder's own wins).
            task_defaults=lambda params: image_defaults if params.input_images else None,
            max_sequence_length_limit=self.config.max_t5_sequence_length,
            default_strength=self.config.default_strength,
            unsupported_params={
                "true_cfg_scale": "SD3 runs classic CFG, set by guidance_scale (with negative_prompt)",
            },
            cfg_mode="classic",
            skip_layer_guidance=SkipLayerGuidanceRule(num_layers=transformer.config.num_layers),
        )
        #: The engine's ControlNets by name (`use_controlnets`), shared with the denoiser.
        self.controlnets: dict[str, SD3ControlNetModel | SD3SingleStreamControlNetModel] = {}
        #: What SD3.5-Large's ControlNets copy (`use_controlnets`).
        self.transformer_pos_embed = transformer.pos_embed
        self.input_validation.controlnet_check = self._check_controlnets
        clip_tokenizer = context.get("tokenizer")
        clip_max_length = clip_context_length(clip_tokenizer, self.config.clip_max_length)
        return [
            self.input_validation,
            SD3TextEncodingStage(
                (clip_tokenizer, context.get("tokenizer_2")),
                (context.get("text_encoder"), context.get("text_encoder_2")),
                context.get_optional("tokenizer_3"),
                context.get_optional("text_encoder_3"),
                clip_max_length=clip_max_length,
                joint_attention_dim=transformer.config.joint_attention_dim,
                output_dtype=context.dtype,
            ),
            # Image-to-image: the input image's latents are the generator's first draw (as in Diffusers).
            InputImageEncodingStage(vae, spatial_latents, device=device, dtype=dtype),
            SpatialLatentPreparationStage(
                latent_channels=transformer.config.in_channels,
                vae_scale_factor=self.vae_scale_factor,
                device=device,
                dtype=dtype,
            ),
            # The control images' posteriors draw from a generator of their own: any place would do.
            SD3ControlImageEncodingStage(vae, self.controlnets, device=device, dtype=dtype),
            DefaultTimestepPreparationStage(scheduler, patch_size=patch),
            ImageToImageNoisingStage(),
            InpaintMaskStage(transformer.config.in_channels, spatial_latents),
            DenoisingStage(SD3Denoiser(transformer, scheduler, self.controlnets)),
            DecodingStage(vae, packed_latents=False),
        ]
