"""Qwen-Image-Layered (Diffusers `QwenImageLayeredPipeline`): one input image decomposed into RGBA layers.

The DiT generates `layers + 1` images at once, all at the input image's size (at the `resolution` bucket's
area): a composite first, then the layers, each a block of packed tokens; the input image's VAE latents
follow them as conditioning tokens, at RoPE frame position -1 (`use_layer3d_rope`). The VAE has four
channels (RGBA) on its pixel side. Decoding drops the composite and decodes every layer on its own, so a
request's `outputs.images` are `layers` RGBA images per output, output after output (Diffusers returns a
list of layers per image; a flat list keeps every front end's "list of images" as it is, and files are
numbered in that order).

Request settings beyond `SamplingParams`, in `extra` (Diffusers' `__call__` arguments and defaults):
`layers` (4), `resolution` (640 or 1024: the input image is resized to about that many pixels squared at
its own aspect ratio, sides multiples of 32, and the layers have that size) and `cfg_normalize` (False:
plain true CFG; True: rescaled to the prompt branch's norm). Beyond Diffusers, a request may set `height`
and `width` (multiples of 16): the input image is then resized to exactly that size, and so are the layers
(what the server's `size` and its warm-up use); left unset, the size is Diffusers'.

Differences from Diffusers, all refused with a message rather than run differently: an empty prompt
(Diffusers then captions the image with the vision-language model; diffserve needs the prompt), image
formats without alpha (`output_format` must be png). The input image's alpha is read as Diffusers reads
an RGBA image: the CLI, HTTP and `DiffGenerator` loaders keep an input's transparency and this family's
validation keeps it (`ImageInputRule.keep_alpha`); an image without transparency is opaque (alpha 255). The negative prompt defaults to " " as in the family's other pipelines
(Diffusers' layered example sends none, which turns true CFG off): send `true_cfg_scale=1` to run without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import SamplingParams
from diffserve.distributed.parallel_vae import decode_split
from diffserve.errors import InvalidRequestError
from diffserve.families.qwen_image.config import QwenImagePipelineConfig, qwen_image_default_sampling_params
from diffserve.families.qwen_image.edit_preparation import check_condition_sizes, condition_size
from diffserve.families.qwen_image.folder_checks import check_qwen_image_folder
from diffserve.families.qwen_image.pipeline import (
    NOT_GUIDANCE_DISTILLED,
    QwenImagePipeline,
    _vae_scale_factor,
    norm_preserving_cfg,
)
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.pipelines.base import PipelineContext
from diffserve.pipelines.cfg_batch import (
    advance_requests,
    branch_texts,
    classic_cfg,
    pad_text,
    split_guided,
    step_cache_for,
)
from diffserve.request import LatentSize, Req, role
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout, tensor_to_pil
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage
from diffserve.stages.latent_preparation import (
    LatentPreparationStage,
    initial_noise,
    pack_latents,
    unpack_latents,
)
from diffserve.stages.previews import predicted_clean_latents
from diffserve.stages.reference_images import ReferenceImages
from diffserve.stages.timestep_preparation import set_schedule
from diffserve.stages.video_vae_decoding import denormalize_latents, normalize_latents

#: The most layers one request may ask for: each costs a full image's tokens in every DiT step (the
#: attention grows with the square of the total) and a VAE decode.
MAX_LAYERS = 16
PIPELINE_NAME = "QwenImageLayeredPipeline"


@dataclass(frozen=True)
class QwenImageLayeredPipelineConfig(QwenImagePipelineConfig):
    """The text-to-image prompt template (Diffusers' layered pipeline uses it), plus the `resolution`
    buckets: bucket -> the pixel area the input image (and so every layer) is resized to."""

    resolution_areas: tuple[tuple[int, int], ...] = ((640, 640 * 640), (1024, 1024 * 1024))


@dataclass(frozen=True)
class QwenImageLayeredSettings:
    """A request's layered settings (`SamplingParams.extra`), with Diffusers' `__call__` defaults."""

    layers: int = option(4, min=1, max=MAX_LAYERS, help="RGBA layers the input image is decomposed into")
    resolution: int = option(
        640, min=1, help="resolution bucket of the input image and the layers: 640 or 1024"
    )
    cfg_normalize: bool = option(False, help="rescale the true-CFG prediction to the prompt branch's norm")


def layered_settings(
    params: SamplingParams, config: QwenImageLayeredPipelineConfig
) -> QwenImageLayeredSettings:
    """The request's settings from `params.extra`: an unknown key or a bad value is an InvalidRequestError."""
    settings = settings_from(QwenImageLayeredSettings, params.extra, "extra")
    buckets = dict(config.resolution_areas)
    if settings.resolution not in buckets:
        raise InvalidRequestError(
            f"extra['resolution'] must be one of {', '.join(map(str, buckets))}, got {settings.resolution!r}",
            param="extra",
        )
    return settings


def layered_size(
    image: Image.Image, settings: QwenImageLayeredSettings, config: QwenImageLayeredPipelineConfig
) -> tuple[int, int]:
    """(width, height) of the resized input image and of every layer (Diffusers' `calculate_dimensions`)."""
    return condition_size(image, dict(config.resolution_areas)[settings.resolution])


def rgba_tensor(image: Image.Image) -> torch.Tensor:
    """PIL image -> (1, 4, H, W) float32 in [-1, 1] (an image without alpha is opaque)."""
    array = np.asarray(image.convert("RGBA"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1)[None] * 2.0 - 1.0


@dataclass
class QwenImageLayeredConditioning(ReferenceImages):
    """The input image's tokens (`ReferenceImages`), the number of layers and the CFG rule."""

    layers: int = 0
    #: Requests in one DiT batch share one CFG rule.
    cfg_normalize: bool = field(default=False, metadata=role(batch="value"))


class QwenImageLayeredInputValidationStage(InputValidationStage):
    """The shared validation plus the layered settings in `extra` and the refusals of the module docstring."""

    takes_family_settings = True
    sets = (*InputValidationStage.sets, "generated.images")

    def __init__(self, config: QwenImageLayeredPipelineConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layered_config = config

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if isinstance(params.prompt, str) and not params.prompt.strip():
            raise InvalidRequestError(
                f"{PIPELINE_NAME} needs a prompt describing the input image (Diffusers captions the image "
                "with its vision-language model when the prompt is empty; diffserve does not)",
                param="prompt",
            )
        if params.output_format not in (None, "png"):
            raise InvalidRequestError(
                f"{PIPELINE_NAME} returns RGBA layers: output_format must be png ({params.output_format} "
                "would drop their transparency)",
                param="output_format",
            )
        layered_settings(params, self.layered_config)  # before the size default reads them
        return super().resolve(params)

    def forward(self, req: Req) -> Req:
        req = super().forward(req)
        # The composite and every layer are full images of tokens in each step, and each layer is decoded.
        req.generated.images = layered_settings(req.params, self.layered_config).layers + 1
        return req

    def size_of(self, params: SamplingParams) -> tuple[int, int]:
        """Default (height, width) of the layers: the input image's, resized to the resolution bucket's area.
        An image too elongated for that (a side rounded to 0) is refused here, when the size is unset."""
        settings = layered_settings(params, self.layered_config)
        if params.height is None or params.width is None:
            area = dict(self.layered_config.resolution_areas)[settings.resolution]
            check_condition_sizes(params.input_images[:1], (area,), PIPELINE_NAME)
        width, height = layered_size(params.input_images[0], settings, self.layered_config)
        return (
            height // self.pixel_multiple * self.pixel_multiple,
            width // self.pixel_multiple * self.pixel_multiple,
        )


class QwenImageLayeredPreparationStage(Stage):
    """The input image resized to the layers' size, VAE-encoded (its posterior's mode, normalised per
    channel) and packed: the conditioning tokens every row of the request appends."""

    sets = (
        "conditioning.condition_images",
        "conditioning.condition_latents",
        "conditioning.condition_shapes",
        "conditioning.layers",
        "conditioning.cfg_normalize",
    )

    def __init__(self, vae: nn.Module, config: QwenImageLayeredPipelineConfig) -> None:
        self.vae = vae
        self.config = config

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        settings = layered_settings(req.params, self.config)
        original = req.params.input_images[0]
        # The size validation chose (Diffusers': `layered_size`, unless the request set one).
        size = (req.params.width, req.params.height)
        image = original.convert("RGBA").resize(size, Image.Resampling.LANCZOS)
        pixels = to_module(self.vae, rgba_tensor(image).unsqueeze(2))
        encoded = normalize_latents(self.vae, self.vae.encode(pixels).mode())[:, :, 0]
        conditioning = QwenImageLayeredConditioning.of(req)
        conditioning.condition_images = [image]
        conditioning.condition_latents = pack_latents(encoded).repeat(req.batch_size, 1, 1)
        conditioning.condition_shapes = [(1, encoded.shape[-2] // 2, encoded.shape[-1] // 2)]
        conditioning.layers = settings.layers
        conditioning.cfg_normalize = settings.cfg_normalize
        return req


def pack_layers(latents: torch.Tensor) -> torch.Tensor:
    """(B, F, C, h, w) -> (B, F * h/2 * w/2, C * 4): each frame's 2x2-patch tokens, frame after frame."""
    b, f = latents.shape[:2]
    tokens = pack_latents(latents.flatten(0, 1))
    return tokens.reshape(b, f * tokens.shape[1], tokens.shape[2])


def unpack_layers(tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack_layers`: (B, F * h/2 * w/2, C * 4) -> (B, F, C, h, w)."""
    b, _, channels = tokens.shape
    grid = unpack_latents(tokens.reshape(b * frames, -1, channels), height, width)
    return grid.unflatten(0, (b, frames))


class QwenImageLayeredLatentPreparationStage(LatentPreparationStage):
    """Noise for the composite and every layer, (batch, layers + 1, channels, h, w) drawn at once as
    Diffusers draws it, packed frame after frame."""

    needs = ("generator", "prompt_embeds", "conditioning.layers")

    def forward(self, req: Req) -> Req:
        p = req.params
        h = 2 * (p.height // (self.vae_scale_factor * 2))
        w = 2 * (p.width // (self.vae_scale_factor * 2))
        frames = QwenImageLayeredConditioning.of(req).layers + 1
        noise = initial_noise(req, (p.num_outputs_per_prompt, frames, self.latent_channels, h, w), self.dtype)
        req.latents = pack_layers(noise).to(self.device)
        req.latent_size = LatentSize(h, w)
        return req


class QwenImageLayeredTimestepPreparationStage(Stage):
    """Diffusers' layered schedule: sigmas 1, 1 - 1/n, ..., 1/n, shifted by mu = sqrt(input-image tokens / 256)."""

    needs = ("latents", "conditioning.condition_latents")
    sets = ("schedule",)

    #: Diffusers' base sequence length: a 256x256 image's 16x16-pixel tokens.
    BASE_TOKENS = 256 * 256 / 16 / 16

    def __init__(self, scheduler: FlowMatchEulerScheduler) -> None:
        self.scheduler = scheduler

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        condition = QwenImageLayeredConditioning.of(req).condition_latents
        assert condition is not None
        mu = math.sqrt(condition.shape[1] / self.BASE_TOKENS)
        sigmas = np.linspace(1.0, 0, steps + 1)[:-1]
        set_schedule(req, self.scheduler.schedule(steps, mu=mu, sigmas=sigmas))
        return req


class QwenImageLayeredDenoiser:
    """One step over layered requests of one batch key: every row reads [composite and layers; input
    image] tokens (their grids as `img_shapes`), and only the generated tokens' prediction is kept."""

    def __init__(self, transformer: QwenImageTransformer2DModel, scheduler: FlowMatchEulerScheduler) -> None:
        self.transformer = transformer
        self.scheduler = scheduler

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        latents, texts, timesteps, shapes = [], [], [], []
        for req in reqs:
            conditioning = QwenImageLayeredConditioning.of(req)
            assert conditioning.condition_latents is not None
            tokens = torch.cat([req.latents, conditioning.condition_latents.to(req.latents.dtype)], dim=1)
            height, width = req.latent_size
            grid = [(1, height // 2, width // 2)] * (conditioning.layers + 1) + list(
                conditioning.condition_shapes
            )
            for text in branch_texts(req):
                latents.append(tokens)
                texts.append(text)
                timesteps.append(req.schedule.timesteps[req.step_index].expand(req.batch_size))
                shapes.extend([grid] * req.batch_size)
        first = reqs[0]
        text, text_mask = pad_text(texts)
        hidden = torch.cat(latents)
        prediction = self.transformer(
            hidden_states=hidden,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=text_mask,
            timestep=torch.cat(timesteps).to(first.latents.dtype) / 1000,
            img_shapes=shapes,
            step_cache=step_cache_for(reqs),
            # 0: RGBA output for every row (Diffusers' `is_rgb`, always 0 in its pipeline).
            additional_t_cond=torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device),
        )
        prediction = prediction[:, : first.latents.shape[1]]
        normalize = QwenImageLayeredConditioning.of(first).cfg_normalize  # one value per batch (its role)
        combine = norm_preserving_cfg if normalize else classic_cfg
        advance_requests(self.scheduler, reqs, split_guided(prediction, reqs, combine=combine))


class QwenImageLayeredDecodingStage(Stage):
    """Every layer (the composite dropped) through the RGBA VAE: `layers` RGBA images per output."""

    needs = ("latents", "latent_size", "conditioning.layers")
    sets = ("outputs.images",)

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae

    def decode_layout(self) -> DecodeLayout:
        return DecodeLayout(self.vae, packed=True, video_vae=True)

    def decode(self, req: Req, latents: torch.Tensor) -> list[Image.Image]:
        """Packed (batch, (layers + 1) * tokens, channels) latents -> batch * layers RGBA images."""
        layers = QwenImageLayeredConditioning.of(req).layers
        grid = unpack_layers(latents, layers + 1, *req.latent_size)[:, 1:]  # the composite is not returned
        grid = grid.flatten(0, 1).unsqueeze(2)  # (batch * layers, channels, 1, h, w)
        frames = decode_split(self.vae, denormalize_latents(self.vae, to_module(self.vae, grid)))
        return tensor_to_pil(frames[:, :, 0])

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        req.outputs.images = self.decode(req, req.latents)
        return req


class QwenImageLayeredPipeline(QwenImagePipeline):
    """Decomposes one input image into `layers` RGBA layers (see the module docstring)."""

    required_components = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
    #: Diffusers' captioning of an empty prompt reads it; diffserve needs a prompt, so only accepts it.
    optional_components = ("processor",)
    config = QwenImageLayeredPipelineConfig()
    conditioning_type: ClassVar[type[ReferenceImages]] = QwenImageLayeredConditioning
    controlnet_classes: ClassVar[dict[str, type]] = {}
    pipeline_name = PIPELINE_NAME

    def validation_stage(self, context: PipelineContext) -> InputValidationStage:
        stage = QwenImageLayeredInputValidationStage(
            self.config,
            defaults=apply_overrides(qwen_image_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_sample_size * self.vae_scale_factor,
            max_sequence_length_limit=self.config.max_sequence_length_limit,
            image_inputs=ImageInputRule(
                pipeline_name=self.pipeline_name,
                task="image-edit",
                min_images=1,
                max_images=1,
                keep_alpha=True,
            ),
            unsupported_params={"guidance_scale": NOT_GUIDANCE_DISTILLED},
        )
        stage.default_size = stage.size_of
        return stage

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        scheduler = context.get("scheduler")
        check_qwen_image_folder(
            transformer, vae, context.get("text_encoder"), self.pipeline_name, layered=True, pixel_channels=4
        )
        self.vae_scale_factor = _vae_scale_factor(vae)
        self.pixel_multiple = self.vae_scale_factor * 2
        self.input_validation = self.validation_stage(context)
        self.controlnets = {}
        device = context.platform.device()
        return [
            self.input_validation,
            QwenImageLayeredPreparationStage(vae, self.config),
            self.text_stage(context),
            QwenImageLayeredLatentPreparationStage(
                latent_channels=transformer.config.in_channels // 4,
                vae_scale_factor=self.vae_scale_factor,
                device=device,
                dtype=context.dtype,
            ),
            QwenImageLayeredTimestepPreparationStage(scheduler),
            DenoisingStage(QwenImageLayeredDenoiser(transformer, scheduler)),
            QwenImageLayeredDecodingStage(vae),
        ]

    def preview_images(self, req: Req) -> list[Image.Image]:
        """The layers as they would be if sampling stopped after the current step (full size)."""
        stage = self.decoding_stage
        assert isinstance(stage, QwenImageLayeredDecodingStage)
        with torch.inference_mode():
            return stage.decode(req, predicted_clean_latents(req).to(req.latents.dtype))
