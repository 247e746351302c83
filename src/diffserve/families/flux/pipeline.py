"""FLUX.1 (Diffusers `FluxPipeline`): stages and the batched denoising step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.errors import ModelLoadError
from diffserve.families.flux.conditioning import FluxConditioning
from diffserve.families.flux.config import FluxPipelineConfig, flux_default_sampling_params
from diffserve.families.flux.controlnet import (
    ControlImageEncodingStage,
    ControlNetRunner,
    check_controlnet_fits,
    check_controlnets,
)
from diffserve.families.flux.controlnet_single_file import XLABS_FLUX_CONTROLNET
from diffserve.families.flux.text_encoding import FluxTextEncodingStage
from diffserve.families.flux.validation import FluxInputValidationStage
from diffserve.layers.rotary import RopeTables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.loader.controlnet_single_file import ControlNetFileLayout
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.controlnets.flux import FluxControlNetModel
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import (
    BranchBatch,
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
from diffserve.stages.image_to_image import (
    ImageToImageNoisingStage,
    InputImageEncodingStage,
    input_image_size,
)
from diffserve.stages.input_validation import ImageInputRule
from diffserve.stages.latent_preparation import PackedLatentIdsPreparationStage, pack_latents
from diffserve.stages.mask_preparation import InpaintMaskStage
from diffserve.stages.packed_ids_rope import packed_ids_rope
from diffserve.stages.text_encoding import clip_context_length
from diffserve.stages.timestep_preparation import TimestepPreparationStage


class FluxLatentPreparationStage(PackedLatentIdsPreparationStage):
    conditioning_type = FluxConditioning


class FluxDenoiser:
    """One denoising step over a list of FLUX requests, each at its own timestep.

    All requests are run as one DiT batch; a request with true CFG contributes its positive and
    negative branches to the same batch (one forward instead of Diffusers' two). Requests in one
    call must share the latent grid and text length (the scheduler buckets by shape).
    """

    def __init__(
        self,
        transformer: FluxTransformer2DModel,
        scheduler: FlowMatchEulerScheduler,
        controlnets: dict[str, FluxControlNetModel] | None = None,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        #: The engine's ControlNets by name (the pipeline's dict: loaded after the stages are built).
        self.controlnets = ControlNetRunner({} if controlnets is None else controlnets)
        #: RoPE tables per request shape (least recently used evicted): a few shapes cover a workload.
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache()

    def rope_for(self, req: Req) -> RopeTables:
        """RoPE tables for the request's shape, computed once per shape rather than once per step (FLUX's
        ids are a pure function of the shape: `packed_ids_rope`)."""
        ids = FluxConditioning.of(req)
        return packed_ids_rope(self._rope_cache, self.transformer, req, ids.text_ids, ids.image_ids)

    def context_for(self, req: Req) -> torch.Tensor:
        """The request's text branches through the DiT's context embedder, once per request.

        The T5 states do not change between steps; embedding them is one (text tokens x 4096) @
        (4096 x inner) matmul per step saved. Small against FLUX.1's 57 blocks (under 0.3% of a step
        at 256x256), but free.
        """
        return embedded_context(self.transformer, req)

    def image_tokens(self, batch: BranchBatch, reqs: list[Req]) -> torch.Tensor:
        """The DiT's image tokens, one row per branch: the noisy latents (Kontext appends its input
        image's tokens; only the noisy tokens' prediction is kept)."""
        return torch.cat(batch.latents)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        batch = gather_branches(reqs)
        schedules = [r.schedule for r in reqs for _ in range(2 if r.do_cfg else 1)]
        guidance = [s.guidance for s in schedules if s.guidance is not None]
        first = reqs[0]
        image_ids, text_ids = FluxConditioning.of(first).image_ids, FluxConditioning.of(first).text_ids
        controls = self.controlnets.residuals(reqs, image_ids, text_ids) if self.controlnets.nets else []
        # Timesteps and guidance are already on the latents' device (timestep preparation put them there).
        prediction = self.transformer(
            hidden_states=self.image_tokens(batch, reqs),
            encoder_hidden_states=None,
            context=torch.cat([self.context_for(r) for r in reqs]),
            pooled_projections=torch.cat(batch.pooled),
            timestep=torch.cat(batch.timesteps).to(first.latents.dtype) / 1000,
            img_ids=image_ids,
            txt_ids=text_ids,
            guidance=torch.cat(guidance) if guidance else None,
            rope=self.rope_for(first),
            step_cache=step_cache_for(reqs),
            **({"controlnet_residuals": controls} if controls else {}),
        )
        prediction = prediction[:, : first.latents.shape[1]]
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs))


class FluxPipeline(Pipeline):
    """FLUX.1 text-to-image, and image-to-image / inpainting from the same folder (Diffusers'
    `FluxImg2ImgPipeline` / `FluxInpaintPipeline`): an optional input image noised by `strength`, and an
    optional mask of the area to repaint.

    Its variants (Kontext, Fill) reuse `build_stages` through its hooks: `image_input_rule`,
    `default_size`, `preparation_stages` (between text encoding and timesteps), `noising_stages` (after
    timesteps) and `denoiser_cls`."""

    required_components = (
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "vae",
        "transformer",
        "scheduler",
    )
    config = FluxPipelineConfig()
    denoiser_cls: ClassVar[type[FluxDenoiser]] = FluxDenoiser
    conditioning_type: ClassVar[type[FluxConditioning]] = FluxConditioning
    #: The ControlNet classes the engine may load for this pipeline by config `_class_name`
    #: (`loader/controlnets.py`); the variants (Kontext, Fill) take none.
    controlnet_classes: ClassVar[dict[str, type]] = {"FluxControlNetModel": FluxControlNetModel}
    #: The single-file ControlNets `--controlnet NAME=FILE.safetensors` loads (`loader/controlnet_single_file.py`).
    controlnet_file_layouts: ClassVar[tuple[ControlNetFileLayout, ...]] = (XLABS_FLUX_CONTROLNET,)
    #: Thresholds from `diffserve calibrate-cache` on the trained demo model (benchmarks/README.md,
    #: "Quality tiers against the exact output").
    #: Calibrate a real checkpoint before trusting them there: a folder's own calibration file wins.
    step_cache_policies = {
        "medium": StepCachePolicy(threshold=0.2, max_reuse_in_a_row=3),
        "low": StepCachePolicy(threshold=0.45, max_reuse_in_a_row=5),
        "draft": StepCachePolicy(threshold=1.6, max_reuse_in_a_row=5),
    }

    #: TeaCache's published rescale polynomial for FLUX.1 (github.com/ali-vilab/TeaCache, TeaCache4FLUX).
    teacache_coefficients = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)
    #: MagCache's residual magnitude ratios of FLUX.1-dev at 28 steps (github.com/Zehong-Ma/MagCache; the
    #: values diffusers ships as `FLUX_MAG_RATIOS`): resampled to other step counts.
    mag_ratios = (
        1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344, 0.98047,
        1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484,
        0.95703, 0.93359, 0.89062,
    )  # fmt: skip

    def use_controlnets(self, nets: dict[str, FluxControlNetModel]) -> None:
        """Serve `nets` by name from now on (requests name them in `controlnets`); ModelLoadError for one
        that does not fit this folder's DiT and VAE (`check_controlnet_fits`)."""
        for name, net in nets.items():
            check_controlnet_fits(name, net, self.denoiser.transformer, self.pixel_multiple)
        self.controlnets.update(nets)

    def condition_channels(self) -> int:
        """Channels a variant appends to every image token the DiT reads (none here; Fill's condition)."""
        return 0

    def image_input_rule(self) -> ImageInputRule:
        """An optional input image (image-to-image, strength 0.6 by default as Diffusers') and mask. (With
        an input image or a ControlNet, the guidance default is Diffusers' 7.0: `FluxInputValidationStage`.)"""
        return ImageInputRule(
            pipeline_name="FluxPipeline",
            max_images=1,
            inpainting=True,
            default_strength=self.config.default_strength,
        )

    def default_sampling_params(self) -> SamplingParams:
        return flux_default_sampling_params()

    def input_image_check(self) -> Callable[[Image.Image], object] | None:
        """What an input image must pass at submission (None: any image; it is resized to the output
        size); raises InvalidRequestError."""
        return None

    def task_defaults(
        self, folder_defaults: dict[str, Any]
    ) -> Callable[[SamplingParams], SamplingParams | None]:
        """`InputValidationStage.task_defaults`: a request with an input image or a ControlNet gets the
        embedded guidance of Diffusers' FLUX.1 img2img, inpainting and ControlNet pipelines
        (`FluxPipelineConfig.conditioned_guidance_scale`) unless the folder sets its own; others (and
        Kontext's and Fill's, whose every request has an input image) the family defaults."""
        guidance = self.config.conditioned_guidance_scale
        if guidance is None:
            return lambda params: None
        conditioned = apply_overrides(
            replace(self.default_sampling_params(), guidance_scale=guidance), folder_defaults
        )
        return lambda params: conditioned if params.input_images or params.controlnets else None

    def default_size(self, default_pixels: int) -> Callable[[SamplingParams], tuple[int, int]]:
        """(height, width) when unset: the input image's size (floored), else the square default.
        (Diffusers' img2img defaults to the square size whatever the input; give a size to get it.)"""
        return lambda params: input_image_size(params, self.pixel_multiple, (default_pixels, default_pixels))

    def preparation_stages(self, context: PipelineContext) -> list[Stage]:
        """The stages between text encoding and timestep preparation: the input image's latents (drawn from
        the generator first, as Diffusers does), then the initial noise."""
        device, dtype = context.platform.device(), context.dtype
        return [
            ControlImageEncodingStage(context.get("vae"), self.controlnets, device=device, dtype=dtype),
            InputImageEncodingStage(context.get("vae"), pack_latents, device=device, dtype=dtype),
            self.latent_preparation_stage(context),
        ]

    def noising_stages(self, context: PipelineContext) -> list[Stage]:
        """After timestep preparation: the strength's truncated schedule and noised start, and the mask."""
        return [ImageToImageNoisingStage(), InpaintMaskStage(self.latent_channels, pack_latents)]

    def latent_preparation_stage(self, context: PipelineContext) -> FluxLatentPreparationStage:
        return FluxLatentPreparationStage(
            latent_channels=self.latent_channels,
            vae_scale_factor=self.vae_scale_factor,
            device=context.platform.device(),
            dtype=context.dtype,
        )

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        clip_tokenizer = context.get("tokenizer")
        self.vae_scale_factor = 2 ** (len(vae.config["block_out_channels"]) - 1)
        self.pixel_multiple = self.vae_scale_factor * self.config.latent_patch_size
        #: Channels of the VAE latents the DiT denoises (its prediction; Fill's input is wider).
        self.latent_channels = int(vae.config["latent_channels"])
        pipeline_name = self.image_input_rule().pipeline_name
        try:
            transformer.check_packed_latents(self.latent_channels, self.condition_channels())
        except ValueError as exc:
            raise ModelLoadError(f"{pipeline_name}: {exc}") from exc
        default_pixels = self.config.default_sample_size * self.vae_scale_factor
        folder_defaults = context.folder_sampling_defaults
        self.input_validation = FluxInputValidationStage(
            defaults=apply_overrides(self.default_sampling_params(), folder_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=default_pixels,
            max_sequence_length_limit=self.config.max_t5_sequence_length,
            image_inputs=self.image_input_rule(),
            default_size=self.default_size(default_pixels),
            task_defaults=self.task_defaults(folder_defaults),
            input_image_check=self.input_image_check(),
        )
        #: The engine's ControlNets by name (`use_controlnets`), shared with the denoiser.
        self.controlnets: dict[str, FluxControlNetModel] = {}
        if self.controlnet_classes:
            name = self.input_validation.image_inputs.pipeline_name
            self.input_validation.controlnet_check = lambda p: check_controlnets(p, self.controlnets, name)
        self.denoiser = self.denoiser_cls(transformer, scheduler, self.controlnets)
        return [
            self.input_validation,
            FluxTextEncodingStage(
                clip_tokenizer,
                context.get("text_encoder"),
                context.get("tokenizer_2"),
                context.get("text_encoder_2"),
                clip_max_length=clip_context_length(clip_tokenizer, self.config.clip_max_length),
                output_dtype=context.dtype,
            ),
            *self.preparation_stages(context),
            TimestepPreparationStage(scheduler, transformer.config.guidance_embeds),
            *self.noising_stages(context),
            DenoisingStage(self.denoiser),
            DecodingStage(vae),
        ]
