"""Qwen-Image (Diffusers `QwenImagePipeline`) and Qwen-Image-Edit (`QwenImageEditPipeline`).

Both share the batched denoising step: every request's positive and (true-CFG) negative branch go
through ONE DiT forward (Diffusers runs the two branches one after the other). The branches' text
lengths differ, so text is right-padded to the longest and masked; the DiT's joint attention never
sees the padding. An edit request's input-image tokens are appended to its noisy image tokens, and
only the prediction for the noisy tokens is kept.

A text-to-image folder also serves image-to-image and inpainting (Diffusers' `QwenImageImg2ImgPipeline`
and `QwenImageInpaintPipeline`): an optional input image noised by `strength` (0.6 by default) and an
optional mask of the area to repaint.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.families.qwen_image.config import (
    QwenImageEditPipelineConfig,
    QwenImageEditPlusPipelineConfig,
    QwenImagePipelineConfig,
    qwen_image_default_sampling_params,
)
from diffserve.families.qwen_image.controlnet import (
    QwenControlImageEncodingStage,
    QwenControlNetRunner,
    QwenImageConditioning,
)
from diffserve.families.qwen_image.edit_preparation import (
    QwenImageEditPreparationStage,
    check_condition_sizes,
    edit_output_size,
)
from diffserve.families.qwen_image.folder_checks import check_qwen_image_folder
from diffserve.families.qwen_image.text_encoding import QwenEditTextEncodingStage, QwenTextEncodingStage
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.controlnets.qwen_image import QwenImageControlNetModel
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import (
    advance_requests,
    branch_texts,
    pad_text,
    split_guided,
    step_cache_for,
)
from diffserve.pipelines.controlnet_steps import check_controlnet_entries
from diffserve.request import Req, batch_signature
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.image_to_image import (
    ImageToImageNoisingStage,
    InputImageEncodingStage,
    encode_sampled_video_vae,
    input_image_size,
)
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage
from diffserve.stages.latent_preparation import LatentPreparationStage, pack_latents
from diffserve.stages.mask_preparation import InpaintMaskStage
from diffserve.stages.reference_images import ReferenceImages
from diffserve.stages.timestep_preparation import TimestepPreparationStage
from diffserve.stages.video_vae_decoding import VideoVaeImageDecodingStage


def norm_preserving_cfg(positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG, rescaled so each token's prediction keeps the positive branch's norm (Qwen-Image)."""
    combined = negative + scale * (positive - negative)
    return combined * (positive.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImageDenoiser:
    """One step over a list of Qwen-Image requests (same latent grid), each at its own timestep."""

    def __init__(
        self,
        transformer: QwenImageTransformer2DModel,
        scheduler: FlowMatchEulerScheduler,
        controlnets: dict[str, QwenImageControlNetModel] | None = None,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        #: The engine's ControlNets by name (the pipeline's dict: loaded after the stages are built).
        self.controlnets = QwenControlNetRunner({} if controlnets is None else controlnets)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        latents, texts, timesteps, shapes, guidance = [], [], [], [], []
        for req in reqs:
            tokens = req.latents
            references = ReferenceImages.of(req)
            if references.condition_latents is not None:
                tokens = torch.cat([tokens, references.condition_latents.to(tokens.dtype)], dim=1)
            height, width = req.latent_size
            grid = [(1, height // 2, width // 2), *references.condition_shapes]
            for text in branch_texts(req):
                latents.append(tokens)
                texts.append(text)
                timesteps.append(req.schedule.timesteps[req.step_index].expand(req.batch_size))
                shapes.extend([grid] * req.batch_size)
                if req.schedule.guidance is not None:
                    guidance.append(req.schedule.guidance)
        first = reqs[0]
        text, text_mask = pad_text(texts)
        controls = self.controlnets.residuals(reqs) if self.controlnets.nets else []
        # Timesteps and guidance are already on the latents' device (timestep preparation put them there).
        prediction = self.transformer(
            hidden_states=torch.cat(latents),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=text_mask,
            timestep=torch.cat(timesteps).to(first.latents.dtype) / 1000,
            img_shapes=shapes,
            guidance=torch.cat(guidance) if guidance else None,
            step_cache=step_cache_for(reqs),  # rows are in `gather_branches` order, as it expects
            **({"controlnet_residuals": controls} if controls else {}),
        )
        prediction = prediction[:, : first.latents.shape[1]]
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs, combine=norm_preserving_cfg))


def _vae_scale_factor(vae) -> int:
    return 2 ** len(vae.config["temperal_downsample"])


NOT_GUIDANCE_DISTILLED = "Qwen-Image is not guidance-distilled; use true_cfg_scale with a negative_prompt"


class QwenImagePipeline(Pipeline):
    #: cache-dit runs its DBCache with the CFG branch apart for this pipeline (`enable_separate_cfg`).
    cache_separate_cfg = True
    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    config = QwenImagePipelineConfig()
    pipeline_name = "QwenImagePipeline"
    #: Empty references for text-to-image and image-to-image (an edit's input images are appended as
    #: tokens), and the request's ControlNet entries.
    conditioning_type: ClassVar[type[ReferenceImages]] = QwenImageConditioning
    #: The ControlNet classes the engine may load for this pipeline by config `_class_name`
    #: (`loader/controlnets.py`); the Edit pipelines take none.
    controlnet_classes: ClassVar[dict[str, type]] = {"QwenImageControlNetModel": QwenImageControlNetModel}
    #: The VAE `input_channels` the pipeline's input images need (None: any; text-to-image decodes what
    #: the VAE gives, as Diffusers does).
    vae_pixel_channels: ClassVar[int | None] = None
    #: Measured on the tiny test model (20 steps, 64x64, text-to-image and edit alike): 14 / 9 / 5 steps in
    #: full for medium / low / draft at about 38 / 32 / 28 dB. Its random weights make the timestep
    #: modulation, hence the signal, jump by ~100% every step, so thresholds above 1 leave the schedule to
    #: `max_reuse_in_a_row` and the full first/last steps; its last steps are the most sensitive ones.
    #: A real checkpoint moves far less per step: `diffserve calibrate-cache` should replace these.
    step_cache_policies = {
        "medium": StepCachePolicy(threshold=1.0, max_reuse_in_a_row=2, full_last_steps=5),
        "low": StepCachePolicy(threshold=3.0, max_reuse_in_a_row=2, full_first_steps=1, full_last_steps=3),
        "draft": StepCachePolicy(threshold=6.0, max_reuse_in_a_row=4, full_first_steps=1, full_last_steps=1),
    }

    def validation_stage(self, context: PipelineContext) -> InputValidationStage:
        transformer = context.get("transformer")
        guidance = transformer.config.guidance_embeds
        default = self.config.default_sample_size * self.vae_scale_factor
        return InputValidationStage(
            defaults=apply_overrides(qwen_image_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=default,
            max_sequence_length_limit=self.config.max_sequence_length_limit,
            image_inputs=ImageInputRule(
                pipeline_name=self.pipeline_name,
                max_images=1,
                inpainting=True,
                default_strength=self.config.default_strength,
            ),
            default_size=lambda params: input_image_size(params, self.pixel_multiple, (default, default)),
            unsupported_params={} if guidance else {"guidance_scale": NOT_GUIDANCE_DISTILLED},
        )

    def text_stage(self, context: PipelineContext) -> Stage:
        return QwenTextEncodingStage(**self.text_stage_kwargs(context))

    def text_stage_kwargs(self, context: PipelineContext) -> dict:
        return {
            "tokenizer": context.get("tokenizer"),
            "text_encoder": context.get("text_encoder"),
            "template": self.config.prompt_template,
            "prefix_tokens": self.config.template_prefix_tokens,
            "tokenizer_max_length": self.config.tokenizer_max_length,
            "output_dtype": context.dtype,
        }

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        return []

    def use_controlnets(self, nets: dict[str, QwenImageControlNetModel]) -> None:
        """Serve `nets` by name from now on (requests name them in `controlnets`)."""
        self.controlnets.update(nets)

    def image_to_image_stages(self, context: PipelineContext) -> list[Stage]:
        """Before latent preparation: the control images' latents, then the optional input image's (the
        generator's first draws, as in Diffusers' `QwenImageControlNetPipeline` and
        `QwenImageImg2ImgPipeline`)."""
        device = context.platform.device()
        return [
            QwenControlImageEncodingStage(context.get("vae"), device, context.dtype),
            InputImageEncodingStage(
                context.get("vae"),
                pack_latents,
                context.platform.device(),
                context.dtype,
                encode=encode_sampled_video_vae,
            ),
        ]

    def noising_stages(self, context: PipelineContext) -> list[Stage]:
        """After timesteps: the strength's truncated schedule and noised start, and the optional mask."""
        channels = context.get("transformer").config.in_channels // 4
        return [ImageToImageNoisingStage(), InpaintMaskStage(channels, pack_latents)]

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        check_qwen_image_folder(
            transformer,
            vae,
            context.get("text_encoder"),
            self.pipeline_name,
            pixel_channels=self.vae_pixel_channels,
        )
        self.vae_scale_factor = _vae_scale_factor(vae)
        self.pixel_multiple = self.vae_scale_factor * 2  # latents are packed in 2x2 patches
        self.input_validation = self.validation_stage(context)
        #: The engine's ControlNets by name (`use_controlnets`), shared with the denoiser.
        self.controlnets: dict[str, QwenImageControlNetModel] = {}
        if self.controlnet_classes:
            name = self.input_validation.image_inputs.pipeline_name
            self.input_validation.controlnet_check = lambda p: check_controlnet_entries(
                p, self.controlnets, name
            )
        return [
            self.input_validation,
            *self.before_denoising_stages(context),
            self.text_stage(context),
            *self.image_to_image_stages(context),
            LatentPreparationStage(
                latent_channels=transformer.config.in_channels // 4,
                vae_scale_factor=self.vae_scale_factor,
                device=context.platform.device(),
                dtype=context.dtype,
            ),
            TimestepPreparationStage(scheduler, guidance_embeds=transformer.config.guidance_embeds),
            *self.noising_stages(context),
            DenoisingStage(QwenImageDenoiser(transformer, scheduler, self.controlnets)),
            VideoVaeImageDecodingStage(vae),
        ]

    def batch_key(self, req: Req) -> tuple:
        """Text lengths may differ (the denoiser pads and masks); image tokens and their grids (the noisy
        one, and the input images' from the conditioning's `batch` roles) must line up."""
        return (
            tuple(req.latents.shape[1:]),
            req.latent_size,
            *batch_signature(req.conditioning),
        )


class QwenImageEditPipeline(QwenImagePipeline):
    """Edits one input image; the output defaults to the input's aspect ratio at ~1 megapixel."""

    required_components = ("text_encoder", "tokenizer", "processor", "vae", "transformer", "scheduler")
    config = QwenImageEditPipelineConfig()
    conditioning_type: ClassVar[type[ReferenceImages]] = ReferenceImages
    controlnet_classes: ClassVar[dict[str, type]] = {}
    pipeline_name = "QwenImageEditPipeline"
    vae_pixel_channels: ClassVar[int | None] = 3

    def validation_stage(self, context: PipelineContext) -> InputValidationStage:
        stage = super().validation_stage(context)
        stage.image_inputs = ImageInputRule(
            pipeline_name=self.pipeline_name, min_images=1, max_images=self.config.max_input_images
        )
        area, multiple = self.config.condition_image_area, self.pixel_multiple
        # The vision-language encoder reads a copy of its own size (Edit-Plus) or the VAE's copy (Edit).
        vision = area if self.config.vision_image_area is None else self.config.vision_image_area

        def default_size(params: SamplingParams) -> tuple[int, int]:
            # Called on every request (a size given or not): the input images must survive the resizing.
            check_condition_sizes(params.input_images, (area, vision), self.pipeline_name, vision)
            return edit_output_size(params, area, multiple)

        stage.default_size = default_size
        return stage

    def text_stage(self, context: PipelineContext) -> Stage:
        return QwenEditTextEncodingStage(
            **self.text_stage_kwargs(context),
            processor=context.get("processor"),
            image_prompt_template=self.config.image_prompt_template,
        )

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        return [
            QwenImageEditPreparationStage(
                context.get("vae"), self.config.condition_image_area, self.config.vision_image_area
            )
        ]

    def image_to_image_stages(self, context: PipelineContext) -> list[Stage]:
        """None: an edit starts from pure noise and reads its input images as conditioning tokens."""
        return []

    def noising_stages(self, context: PipelineContext) -> list[Stage]:
        return []


class QwenImageEditPlusPipeline(QwenImageEditPipeline):
    """Edits from one to three input images (each becomes its own block of conditioning tokens)."""

    config = QwenImageEditPlusPipelineConfig()
    pipeline_name = "QwenImageEditPlusPipeline"
