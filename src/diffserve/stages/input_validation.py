"""InputValidationStage: fill family defaults, validate, and create the request's noise generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image

from diffserve.configs.cache_rule import CacheRule, check_cache_steps, check_tier_steps, choose_cache
from diffserve.configs.cache_settings import CacheSettings
from diffserve.configs.quality import EXACT, QualityRule
from diffserve.configs.sampling_params import (
    SKIP_LAYER_GUIDANCE_FIELDS,
    SamplingParams,
    check_controlnets,
    check_strength,
)
from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import without_alpha
from diffserve.masks import check_mask_size, pipeline_mask
from diffserve.models.cache_methods.registry import add_cfg_branch, new_request_cache, new_tier_cache
from diffserve.request import Req
from diffserve.runtime.contract import CfgMode, VideoProbe
from diffserve.stages.base import Stage
from diffserve.stages.image_to_image import input_image_size, kept_steps
from diffserve.video_inputs import refuse_input_video


@dataclass(frozen=True)
class ImageInputRule:
    """Which input images (and masks) a family takes; a request that sends others gets a 400.

    `default_strength` (not None): the family runs image-to-image from an input image, noised by
    `strength` (this default when unset); with `inpainting` it also takes a mask of the input image's size
    (`mask_required`: it needs one, FLUX.1 Fill). `check` fills in the strength default and puts the mask
    in the form the pipelines read (`diffserve.masks.pipeline_mask`), in place."""

    pipeline_name: str = "this pipeline"
    task: str = "text-to-image"
    min_images: int = 0
    max_images: int = 0
    inpainting: bool = False
    default_strength: float | None = None
    #: The default strength of a request with a mask, when it differs (Z-Image's inpainting: 1.0).
    default_inpaint_strength: float | None = None
    mask_required: bool = False
    #: Input images keep their alpha channel (Qwen-Image-Layered decomposes RGBA); elsewhere an RGBA input
    #: is converted to RGB here, its alpha dropped (not composited), whichever surface loaded it.
    keep_alpha: bool = False

    def check_requested_strength(self, params: SamplingParams) -> None:
        """The request's own `strength` (before defaults): a number in [0, 1], on a family that noises an
        input image, sent with one. (A folder default for strength applies only to requests with an image.)"""
        check_strength(params.strength)
        if params.strength is None:
            return
        if self.default_strength is None:
            raise InvalidRequestError(
                f"strength is not a parameter of {self.pipeline_name}: it does not start from a noised input "
                "image; send the request without strength",
                param="strength",
            )
        if not params.input_images:
            raise InvalidRequestError(
                "strength applies to image-to-image: send an input image with it, or leave strength out",
                param="strength",
            )

    def check(self, params: SamplingParams) -> None:
        """The resolved request (defaults applied; `check_requested_strength` ran on it before)."""
        images = params.input_images or []
        self._resolve_strength(params, images)
        if images and self.max_images == 0:
            raise InvalidRequestError(
                f"{self.pipeline_name} is a {self.task} model and takes no input image; image edits need "
                "an image-edit model, animating an image an image-to-video model",
                param="image",
            )
        if len(images) < self.min_images:
            raise InvalidRequestError(f"{self.pipeline_name} needs an input image", param="image")
        if len(images) > self.max_images:
            raise InvalidRequestError(
                f"{self.pipeline_name} takes at most {self.max_images} input image(s), got {len(images)}",
                param="image",
            )
        for image in images:
            if not isinstance(image, Image.Image):
                raise InvalidRequestError(
                    f"input images must be decoded PIL images, got {type(image).__name__}; "
                    "use diffserve.image_inputs.load_image for paths, bytes and data URLs",
                    param="image",
                )
        if images and not self.keep_alpha:
            params.input_images = without_alpha(images)
        if params.mask_image is not None and not self.inpainting:
            raise InvalidRequestError(
                f"mask is not supported by {self.pipeline_name}: it edits the whole image from the prompt "
                "and cannot restrict the edit to a masked region; send the request without a mask",
                param="mask",
            )
        self._check_mask(params, images)

    def _resolve_strength(self, params: SamplingParams, images: list) -> None:
        """Strength only where an input image is noised (else None), the family default filled in, and at
        least one step left after Diffusers' truncation (`stages/image_to_image.py`)."""
        check_strength(params.strength)
        if self.default_strength is None or not images:
            params.strength = None
            return
        if params.strength is None:
            inpainting = params.mask_image is not None and self.default_inpaint_strength is not None
            params.strength = self.default_inpaint_strength if inpainting else self.default_strength
        steps = params.num_inference_steps
        if isinstance(steps, int) and steps >= 1 and kept_steps(steps, params.strength) < 1:
            raise InvalidRequestError(
                f"strength={params.strength:g} with num_inference_steps={steps} leaves no denoising step "
                f"(Diffusers keeps {steps} - int({steps} * (1 - strength)) of them); raise strength or "
                "num_inference_steps",
                param="strength",
            )

    def _check_mask(self, params: SamplingParams, images: list) -> None:
        """The mask (required or optional) of the input image's size, as the pipelines read it."""
        if not self.inpainting:
            return
        if params.mask_image is None:
            if self.mask_required:
                raise InvalidRequestError(
                    f"{self.pipeline_name} needs a mask: transparent pixels (or white ones, in a mask without "
                    "alpha) mark the area to fill",
                    param="mask",
                )
            return
        if not isinstance(params.mask_image, Image.Image):
            raise InvalidRequestError(
                f"mask must be a decoded PIL image, got {type(params.mask_image).__name__}; use "
                "diffserve.image_inputs.load_image(..., keep_alpha=True) for paths, bytes and data URLs",
                param="mask",
            )
        if not images:
            raise InvalidRequestError("a mask needs the input image it applies to", param="mask")
        check_mask_size(params.mask_image, images[0])
        params.mask_image = pipeline_mask(params.mask_image)


VIDEO_FIELDS = ("num_frames", "fps", "video_format")
VIDEO_FORMATS = ("mp4", "gif", "webp")


@dataclass(frozen=True)
class VideoRule:
    """What a video family accepts: `num_frames` = temporal_factor * k + 1 (the causal VAE's grouping)."""

    temporal_factor: int = 4
    max_frames: int = 1025
    max_fps: int = 120

    def check(self, params: SamplingParams) -> None:
        n, f = params.num_frames, self.temporal_factor
        top = (self.max_frames - 1) // f * f + 1  # the largest valid count
        if isinstance(n, int) and n > self.max_frames:
            nearest = f"{top} or {top - f}" if top > f else str(top)
            raise InvalidRequestError(
                f"num_frames must be at most {self.max_frames} (and {f}k+1: 1, {f + 1}, {2 * f + 1}, ...), "
                f"got {n!r}; try {nearest}",
                param="num_frames",
            )
        if not isinstance(n, int) or n < 1 or (n - 1) % f:
            lower = min(top, max(1, (n - 1) // f * f + 1)) if isinstance(n, int) and n > 1 else 1
            nearest = f"{lower} or {lower + f}" if lower + f <= top else str(lower)
            raise InvalidRequestError(
                f"num_frames must be {f}k+1 (1, {f + 1}, {2 * f + 1}, ... up to {self.max_frames}), got {n!r}; "
                f"try {nearest}",
                param="num_frames",
            )
        if not isinstance(params.fps, int) or not 1 <= params.fps <= self.max_fps:
            raise InvalidRequestError(
                f"fps must be an integer in [1, {self.max_fps}], got {params.fps!r}", param="fps"
            )
        if params.video_format not in VIDEO_FORMATS:
            raise InvalidRequestError(
                f"video_format must be one of {', '.join(VIDEO_FORMATS)}, got {params.video_format!r}",
                param="video_format",
            )


@dataclass(frozen=True)
class SkipLayerGuidanceRule:
    """A family with skip-layer guidance (SD3.5): its DiT's block count bounds `skip_guidance_layers`,
    and the guidance applies to the prompt's CFG branch, so it needs CFG on."""

    num_layers: int

    def check(self, params: SamplingParams) -> None:
        layers = params.skip_guidance_layers
        if layers is None:
            return
        bad = [i for i in layers if i >= self.num_layers]
        if bad:
            raise InvalidRequestError(
                f"skip_guidance_layers {bad} are outside this model's DiT blocks 0..{self.num_layers - 1}",
                param="skip_guidance_layers",
            )
        if not (params.guidance_scale is not None and params.guidance_scale > 1):
            raise InvalidRequestError(
                "skip_guidance_layers needs classifier-free guidance (guidance_scale > 1, "
                f"got {params.guidance_scale!r}): skip-layer guidance corrects the prompt's CFG branch",
                param="skip_guidance_layers",
            )


class InputValidationStage(Stage):
    # and step_cache, for an approximate quality tier or a cache method
    sets = ("generator", "do_cfg", "generated.size")

    #: Whether the family reads its own settings from `SamplingParams.extra` (it checks them in its
    #: `resolve`); a family that does not refuses a request that sends any, naming them.
    takes_family_settings: ClassVar[bool] = False
    #: Whether the family extends an input video (`SamplingParams.input_video`: `generate(video=...)`,
    #: `diffserve generate --video`, POST /v1/videos' `video`); one that does not refuses a request that
    #: sends one (`refuse_input_video`).
    takes_input_video: ClassVar[bool] = False

    def __init__(
        self,
        defaults: SamplingParams,
        pixel_multiple: int,
        default_pixels: int,
        max_sequence_length_limit: int | None,
        cfg_mode: CfgMode = "true_cfg",
        image_inputs: ImageInputRule | None = None,
        unsupported_params: dict[str, str] | None = None,
        default_size: Callable[[SamplingParams], tuple[int, int]] | None = None,
        video: VideoRule | None = None,
        skip_layer_guidance: SkipLayerGuidanceRule | None = None,
        expert_guidance: bool = False,
        generation_size: Callable[[SamplingParams], tuple[int, int]] | None = None,
        task_defaults: Callable[[SamplingParams], SamplingParams | None] | None = None,
    ) -> None:
        """`unsupported_params`: fields this family lacks -> why (a request setting one gets a 400).
        `default_size(params)`: (height, width) when unset. `generation_size(params)`: the (height, width)
        the family generates resolved `params` at, where that is not their own size (`generated_size`). `video`: None refuses the video fields.
        `skip_layer_guidance`: None refuses the skip-layer guidance fields. `expert_guidance`: the family
        reads `guidance_scale_2` (Wan 2.2 A14B's second expert); otherwise a request setting it gets a 400.
        `task_defaults(params)`: the defaults of the Diffusers pipeline a request's inputs select where they
        differ from `defaults` (FLUX.1's and SD3's image-to-image, inpainting and ControlNet pipelines: the
        family serves them all from one folder), None for `defaults`; built over the folder's own defaults
        like `defaults`, so a folder's choice applies to every task."""

        self.defaults = defaults
        self.pixel_multiple = pixel_multiple
        self.default_pixels = default_pixels
        self.max_sequence_length_limit = max_sequence_length_limit
        self.cfg_mode = cfg_mode
        self.image_inputs = image_inputs or ImageInputRule()
        self.unsupported_params = unsupported_params or {}
        self.default_size = default_size
        self.video = video
        self.skip_layer_guidance = skip_layer_guidance
        self.expert_guidance = expert_guidance
        self.generation_size = generation_size
        self.task_defaults = task_defaults
        self.quality = QualityRule(family=self.image_inputs.pipeline_name)
        #: The `cache` methods its DiT runs, and the engine's `--cache-default` (the pipeline sets both).
        self.cache_rule = CacheRule(family=self.image_inputs.pipeline_name)
        self.default_cache: CacheSettings | None = None
        #: The family's model checks of `controlnets` (set by a pipeline that serves ControlNets); None: a
        #: request listing any is refused.
        self.controlnet_check: Callable[[SamplingParams], None] | None = None

    def video_probe(self) -> VideoProbe | None:
        """What a probe request (warm-up, calibration, /health_generate) must add for this family to accept
        it: None but for families that extend an input video (`takes_input_video`), which need one."""
        return None

    def probe_frames(self) -> int:
        """A video family's frames in a probe request (`PipelineFacts.probe_frames`): the fewest this family
        accepts that leave at least one step to denoise. One (valid under every `VideoRule`: temporal
        factor x 0 + 1) unless a family's first frames come given and its windows are whole blocks."""
        return 1

    def probe_steps(self) -> int:
        """Denoising steps in a probe request (`PipelineFacts.probe_steps`): the fewest this family's
        schedule accepts. One unless a family's `resolve` refuses a one-step request."""
        return 1

    def probe_size(self) -> tuple[int, int] | None:
        """(height, width) every probe request asks for (`PipelineFacts.probe_size`) where the family
        generates one size only; None (square probes of the size each probe chooses) unless a family's DiT
        has positions for one size (CogVideoX 1.0-5B-I2V's learned ones)."""
        return None

    def probe_extra(self) -> tuple[tuple[str, object], ...]:
        """Family settings (`SamplingParams.extra`) a probe request sets (`PipelineFacts.probe_extra`) so that
        this family accepts it and generates it at the size it asks for, as its memory cost counts it. None
        unless a family's setting changes the generated size (SANA-Video's resolution binning)."""
        return ()

    def generated_size(self, params: SamplingParams) -> tuple[int, int]:
        """(height, width) the family generates resolved `params` at: their own size unless a size rule
        applied after `resolve` changes it (SANA's resolution bins). What the memory model costs
        (`Req.generated.size`); a rule that `resolve` applies itself (HiDream's area) is already in it."""
        if self.generation_size is not None:
            return self.generation_size(params)
        return int(params.height), int(params.width)

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """Family defaults applied and validated; raises InvalidRequestError on bad input."""
        if params.input_video is not None and not self.takes_input_video:
            raise refuse_input_video(self.image_inputs.pipeline_name)
        for name, why in self.unsupported_params.items():
            if getattr(params, name) is not None:
                raise InvalidRequestError(
                    f"{name} is not a parameter of {self.image_inputs.pipeline_name}: {why}", param=name
                )
        if self.video is None:
            for name in VIDEO_FIELDS:
                if getattr(params, name) is not None:
                    raise InvalidRequestError(
                        f"{name} applies to video models; {self.image_inputs.pipeline_name} generates images",
                        param=name,
                    )
        if self.skip_layer_guidance is None:
            for name in SKIP_LAYER_GUIDANCE_FIELDS:
                if getattr(params, name) is not None:
                    raise InvalidRequestError(
                        f"{name} is not a parameter of {self.image_inputs.pipeline_name}: skip-layer "
                        "guidance is a Stable Diffusion 3.5 feature",
                        param=name,
                    )
        if params.guidance_scale_2 is not None and not self.expert_guidance:
            raise InvalidRequestError(
                f"guidance_scale_2 is not a parameter of {self.image_inputs.pipeline_name}: it is the "
                "low-noise expert's CFG scale of Wan 2.2 A14B (two-expert) folders",
                param="guidance_scale_2",
            )
        if params.controlnets:
            if self.controlnet_check is None:
                raise InvalidRequestError(
                    f"controlnets is not a parameter of {self.image_inputs.pipeline_name}: this family serves no "
                    "ControlNets (--controlnet NAME=PATH)",
                    param="controlnets",
                )
            check_controlnets(params.controlnets)
            self.controlnet_check(params)
        self.image_inputs.check_requested_strength(params)
        task = self.task_defaults(params) if self.task_defaults is not None else None
        resolved = params.with_defaults(self.defaults if task is None else task)
        resolved.quality = self.quality.resolve(params.quality)
        resolved.cache, resolved.quality = choose_cache(
            params.cache, params.quality, resolved.quality, self.cache_rule, self.default_cache
        )
        self.image_inputs.check(resolved)
        if self.video is not None:
            self.video.check(resolved)
        height, width = (
            self.default_size(resolved) if self.default_size else (self.default_pixels, self.default_pixels)
        )
        resolved.height = height if resolved.height is None else resolved.height
        resolved.width = width if resolved.width is None else resolved.width
        resolved.validate(self.pixel_multiple, self.max_sequence_length_limit)
        if self.skip_layer_guidance is not None:  # after `validate`: the fields' types are checked there
            self.skip_layer_guidance.check(resolved)
        steps = resolved.num_inference_steps
        if resolved.input_images and resolved.strength is not None:  # image-to-image runs the last steps
            steps = kept_steps(steps, resolved.strength)
        check_cache_steps(resolved.cache, steps)
        if resolved.quality != EXACT:
            check_tier_steps(resolved.quality, self.quality.policies[resolved.quality], steps)
        if resolved.extra and not self.takes_family_settings:
            raise InvalidRequestError(
                f"{self.image_inputs.pipeline_name} takes no family settings in extra, got "
                f"{', '.join(map(repr, sorted(resolved.extra)))}",
                param="extra",
            )
        return resolved

    def forward(self, req: Req) -> Req:
        req.params = self.resolve(req.params)
        req.generated.size = self.generated_size(req.params)
        # A CPU generator: a seed gives the same image on every device, and Diffusers' with a CPU generator.
        req.generator = torch.Generator("cpu").manual_seed(req.params.seed)
        p, rule = req.params, self.cache_rule
        if p.quality != EXACT:
            preset = self.quality.policies[p.quality]  # resolved for the DiT when the pipeline started
            req.step_cache = new_tier_cache(p.quality, preset, rule.num_blocks, rule.range_offset)
        else:
            req.step_cache = new_request_cache(p.cache, rule.num_blocks, rule.range_offset)
        if self.cfg_mode == "none":
            req.do_cfg, req.cfg_scale = False, 1.0
        elif self.cfg_mode == "true_cfg":
            req.do_cfg = bool(p.true_cfg_scale and p.true_cfg_scale > 1 and p.negative_prompt is not None)
            req.cfg_scale = float(p.true_cfg_scale or 1.0)
        else:
            threshold = 1.0 if self.cfg_mode == "classic" else 0.0
            req.do_cfg = bool(p.guidance_scale is not None and p.guidance_scale > threshold)
            req.cfg_scale = float(p.guidance_scale or 0.0)
            if req.do_cfg and p.negative_prompt is None:
                p.negative_prompt = ""
        return req

    def add_cfg_branch_cache(self, req: Req) -> None:
        """What the request's cache does with its CFG branch (`registry.add_cfg_branch`): called once its
        CFG decision is final (a family's stage or guider may take it after this stage's `forward`)."""
        if req.step_cache is None or not req.do_cfg:
            return
        p, rule = req.params, self.cache_rule
        settings = self.quality.policies[p.quality] if p.quality != EXACT else p.cache
        add_cfg_branch(req.step_cache, settings, rule.num_blocks, rule.range_offset)


class FamilySettingsValidationStage(InputValidationStage):
    """`InputValidationStage` for a family whose one rule beyond the shared ones is its settings in
    `SamplingParams.extra`: `settings(params)` reads and checks them (an InvalidRequestError naming `extra`
    for an unknown key or a bad value; the value it returns is not kept)."""

    takes_family_settings = True

    def __init__(self, *args: Any, settings: Callable[[SamplingParams], object], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        self.settings(resolved)
        return resolved


def one_image_input_validation(
    pipeline_name: str,
    defaults: SamplingParams,
    pixel_multiple: int,
    default_pixels: int,
    max_sequence_length_limit: int | None,
    default_strength: float | None,
    default_inpaint_strength: float | None = None,
    stage_cls: type[InputValidationStage] = InputValidationStage,
    **options: Any,
) -> InputValidationStage:
    """The input validation of a text-to-image pipeline that also runs image-to-image and inpainting from
    the same folder: at most one input image (and a mask), noised by `default_strength` (with a mask,
    `default_inpaint_strength` where that differs) unless the request sets it. A request that leaves its
    size unset gets the input image's, floored to `pixel_multiple` (Diffusers' img2img takes the square
    default instead), else the square `default_pixels`. `stage_cls`: the validation stage's class (a family's
    subclass with rules of its own); `options`: the rest of its keywords (CFG mode, unsupported parameters,
    ...)."""
    return stage_cls(
        defaults=defaults,
        pixel_multiple=pixel_multiple,
        default_pixels=default_pixels,
        max_sequence_length_limit=max_sequence_length_limit,
        image_inputs=ImageInputRule(
            pipeline_name=pipeline_name,
            max_images=1,
            inpainting=True,
            default_strength=default_strength,
            default_inpaint_strength=default_inpaint_strength,
        ),
        default_size=lambda params: input_image_size(
            params, pixel_multiple, (default_pixels, default_pixels)
        ),
        **options,
    )
