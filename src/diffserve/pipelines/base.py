"""`Pipeline`: an ordered list of stages over one `Req`, plus the loaded components they share; it
implements the engine's `EnginePipeline` contract (runtime/contract.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from diffserve.configs.cache_rule import CacheRule
from diffserve.configs.cache_settings import CacheSettings, FasterCacheSettings, NoCache
from diffserve.configs.quality import EXACT, QualityRule, TierPreset, check_default_quality, describe_preset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.loader.component_loader import LoadedComponent
from diffserve.platforms import Platform
from diffserve.request import Conditioning, Req, batch_signature
from diffserve.runtime.contract import PipelineFacts
from diffserve.stages.base import Stage
from diffserve.stages.decoding import LatentDecoder
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import InputValidationStage
from diffserve.stages.previews import preview_images

logger = logging.getLogger("diffserve.pipeline")


@dataclass(frozen=True)
class PipelineContext:
    """What every pipeline is built from: loaded components and where they run."""

    components: dict[str, LoadedComponent]
    platform: Platform
    dtype: torch.dtype
    #: Sampling defaults the model folder itself recommends (its diffserve.json), over the family's.
    folder_sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: model_index.json's pipeline-level settings (not components), e.g. Wan 2.2's "expand_timesteps".
    pipeline_options: dict[str, Any] = field(default_factory=dict)
    #: What quality "auto" means for this engine (`--default-quality`; any name it accepts).
    default_quality: str = EXACT
    #: Presets per quality tier from the model folder's calibration file (over the family's own).
    calibrated_step_cache: dict[str, TierPreset] = field(default_factory=dict)
    #: The cache of requests that set neither `cache` nor an approximate quality (`--cache-default`).
    default_cache: CacheSettings | None = None

    def get(self, name: str) -> Any:
        return self.components[name].value

    def get_optional(self, name: str) -> Any | None:
        """An optional component's value, or None when the folder does not have it."""
        component = self.components.get(name)
        return None if component is None else component.value


class Pipeline:
    """Subclasses list their required components and build their stages in `build_stages`."""

    required_components: ClassVar[tuple[str, ...]] = ()
    #: Components the pipeline uses when the folder has them (model_index.json may set them to null).
    optional_components: ClassVar[tuple[str, ...]] = ()
    #: Height and width must be multiples of this (set by `build_stages` from the loaded VAE).
    pixel_multiple: int
    #: The approximate quality tiers this family has, each with its measured preset: a cache method and its
    #: settings, or the original step cache (`configs/quality.py`); empty: only "high", the exact path, is
    #: served (a DiT without a step cache, or few steps, an expert switch or diffusion forcing that leave
    #: nothing a tier could keep), and `diffserve calibrate-cache` refuses the family.
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {}
    #: The family's TeaCache coefficients and MagCache ratios, the defaults of those settings (None: the
    #: family records none; a magcache request must then bring its ratios).
    teacache_coefficients: ClassVar[tuple[float, ...] | None] = None
    mag_ratios: ClassVar[tuple[float, ...] | None] = None
    #: DBCache's `enable_separate_cfg` default for the family, cache-dit's (true where diffusers' pipeline
    #: runs the CFG branch as a transformer call of its own), and whether the family can give the CFG
    #: branch a cache state of its own (`pipelines/cfg_batch.step_cache_for`).
    cache_separate_cfg: ClassVar[bool] = False
    cache_separate_cfg_supported: ClassVar[bool] = True
    #: Whether the denoiser takes a CFG request as one branch's view (`runtime.runner.CfgBranchView`, guided
    #: through `split_guided`): CFG-parallel, and FasterCache's steps that skip the negative branch.
    runs_branch_views: ClassVar[bool] = True
    #: The family's typed conditioning (`Req.conditioning`): every request gets an empty one before its
    #: pre-denoise stages, so all requests of the pipeline carry the same class (None: the family needs none).
    conditioning_type: ClassVar[type[Conditioning] | None] = None

    def __init__(self, context: PipelineContext) -> None:
        self.context = context
        self.stages: list[Stage] = self.build_stages(context)
        self._denoising_index = self._find_denoising_stage()
        logger.info("Pipeline stages: %s", [s.name for s in self.stages])
        name = type(self).__name__
        if context.calibrated_step_cache and not self.step_cache_policies:
            raise ValueError(f"the model folder has step-cache calibration, but {name} has no step cache")
        self._use_cache_methods(context)
        self.use_step_cache_policies({**self.step_cache_policies, **context.calibrated_step_cache})
        self._facts = self._declare_facts()
        if self.quality_rule.policies:
            logger.info(
                "Quality tiers: high (exact), %s; default %s",
                ", ".join(
                    f"{tier} ({describe_preset(preset)})"
                    for tier, preset in self.quality_rule.policies.items()
                ),
                self.quality_rule.default_tier,
            )

    def use_step_cache_policies(self, policies: dict[str, TierPreset]) -> None:
        """Serve these approximate tiers from now on, each preset resolved for the DiT (a preset it cannot
        run is a ValueError naming the tier); `diffserve calibrate-cache` tries candidates through this."""
        resolved = {tier: self.cache_rule.resolve_preset(tier, preset) for tier, preset in policies.items()}
        rule = QualityRule(
            default_tier=self.context.default_quality, policies=resolved, family=type(self).__name__
        )
        rule.resolve(None)  # a default tier the family does not have fails at startup, not per request
        self.quality_rule = rule
        self.input_validation_stage.quality = rule

    def _use_cache_methods(self, context: PipelineContext) -> None:
        """The `cache` methods requests may name (those the DiT runs) and the engine's default; a default
        the DiT cannot run, or one next to an approximate `--default-quality`, fails at startup."""
        transformer = context.get("transformer")
        rule = CacheRule(
            family=type(self).__name__,
            methods=getattr(transformer, "cache_methods", frozenset()),
            num_blocks=transformer.cache_block_count() if hasattr(transformer, "cache_block_count") else 0,
            range_offset=transformer.cache_range_offset()
            if hasattr(transformer, "cache_range_offset")
            else 0,
            teacache_coefficients=self.teacache_coefficients,
            mag_ratios=self.mag_ratios,
            separate_cfg=self.cache_separate_cfg,
            separate_cfg_supported=self.cache_separate_cfg_supported,
        )
        default = rule.resolve(context.default_cache)  # InvalidRequestError: reported as --cache-default's
        default = None if isinstance(default, NoCache) else default
        default_tier = check_default_quality(context.default_quality)
        if default is not None and default_tier != EXACT:
            raise ValueError(
                f"--cache-default and --default-quality {default_tier} both choose how "
                "requests reuse DiT work; pass one of them"
            )
        self.cache_rule = rule
        self.input_validation_stage.cache_rule = rule
        self.input_validation_stage.default_cache = default

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        raise NotImplementedError

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """The params with family defaults applied, validated (raises InvalidRequestError)."""
        return self.input_validation_stage.resolve(params)

    # -- The engine's phases (runtime/contract.py `EnginePipeline`) ----------------------------------
    # A request is validated once when it is submitted, runs its pre-denoise stages alone, shares
    # denoising steps with every running request of the same `batch_key`, then runs its post-denoise
    # stages (decoding) alone.

    @property
    def facts(self) -> PipelineFacts:
        return self._facts

    def _declare_facts(self) -> PipelineFacts:
        validation = self.input_validation_stage
        video = validation.video
        transformer = self.context.get("transformer")
        return PipelineFacts(
            name=validation.image_inputs.pipeline_name,
            pixel_multiple=int(self.pixel_multiple),
            dit_width=int(transformer.hidden_width),
            dtype=self.context.dtype,
            cfg_mode=validation.cfg_mode,
            min_input_images=validation.image_inputs.min_images,
            max_input_images=validation.image_inputs.max_images,
            requires_mask=validation.image_inputs.mask_required,
            inpainting=validation.image_inputs.inpainting,
            makes_video=video is not None,
            temporal_factor=1 if video is None else video.temporal_factor,
            max_frames=0 if video is None else video.max_frames,
            max_fps=0 if video is None else video.max_fps,
            video_probe=validation.video_probe(),
            probe_frames=validation.probe_frames(),
            probe_steps=validation.probe_steps(),
            probe_extra=validation.probe_extra(),
            probe_size=validation.probe_size(),
        )

    @property
    def input_validation_stage(self) -> InputValidationStage:
        """The first stage of every family: defaults, validation, CFG rule and quality tier."""
        stage = self.stages[0]
        if not isinstance(stage, InputValidationStage):
            raise TypeError(f"{type(self).__name__}'s first stage must be its InputValidationStage")
        return stage

    @property
    def denoising_stage(self) -> DenoisingStage:
        return self.stages[self._denoising_index]  # type: ignore[return-value]

    def _find_denoising_stage(self) -> int:
        indices = [i for i, s in enumerate(self.stages) if isinstance(s, DenoisingStage)]
        if len(indices) != 1:
            raise TypeError(f"{type(self).__name__} must have exactly one DenoisingStage, has {len(indices)}")
        return indices[0]

    def validate(self, req: Req) -> Req:
        """Defaults, validation, generator, CFG decision and quality tier: once, at submission."""
        stage = self.input_validation_stage
        req = self.run_stage(stage, req)
        check_fastercache_branches(req, self.runs_branch_views)
        stage.add_cfg_branch_cache(req)
        return req

    def run_stage(self, stage: Stage, req: Req) -> Req:
        return stage(req, self.context.platform)

    def run_pre_denoise(self, req: Req) -> Req:
        """Text/image encoding, latents and timesteps of a validated request."""
        if req.conditioning is None and self.conditioning_type is not None:
            req.conditioning = self.conditioning_type()
        for stage in self.stages[1 : self._denoising_index]:
            req = self.run_stage(stage, req)
        return req

    def denoise_step(self, reqs: list[Req]) -> None:
        """One denoising step for every request in `reqs` (same `batch_key`), as one DiT batch."""
        self.denoising_stage.denoise_step(reqs)

    def run_post_denoise(self, req: Req) -> Req:
        """Decoding (and any stage after it) once the request's last step is done."""
        for stage in self.stages[self._denoising_index + 1 :]:
            req = self.run_stage(stage, req)
        return req

    @property
    def decoding_stage(self) -> LatentDecoder:
        """The stage right after the denoising steps, which turns latents into outputs."""
        stage = self.stages[self._denoising_index + 1]
        if not isinstance(stage, LatentDecoder):
            raise TypeError(
                f"{type(self).__name__}'s stage after denoising must decode latents, not {stage.name}"
            )
        return stage

    def preview_images(self, req: Req) -> list[Image.Image]:
        return preview_images(self.decoding_stage, req)

    def batch_key(self, req: Req) -> tuple:
        """Requests with equal keys can share a denoising step: the DiT batch concatenates their
        latents and text along the batch axis, so those shapes must agree, and so must the latent grid
        (packed latents of 48x80 and 80x48 have the same shape but other position ids), and so must what
        the family's conditioning declares with a `batch` role (`request.batch_signature`). Families whose
        DiT pads text itself (Qwen-Image, Z-Image) override this with a looser key."""
        return (
            tuple(req.latents.shape[1:]),
            req.latent_size,
            tuple(req.prompt_embeds.shape[1:]),
            *batch_signature(req.conditioning),
        )


def check_fastercache_branches(req: Req, runs_branch_views: bool) -> None:
    """A 400 naming `cache` for a `fastercache` request whose `is_guidance_distilled` does not fit its CFG
    (whatever decided it: the family's CFG rule or its guider): false without CFG (there is no negative
    branch to approximate); approximating the negative branch where the family runs every branch together
    (`runs_branch_views` false) or with skip-layer guidance (its extra forward reads both branches)."""
    settings = req.params.cache
    if not isinstance(settings, FasterCacheSettings):
        return
    if not req.do_cfg:
        if settings.is_guidance_distilled is False:
            raise InvalidRequestError(
                "cache: fastercache.is_guidance_distilled false approximates the negative-prompt branch, and "
                "this request runs no classifier-free guidance: leave it null (or true)",
                param="cache",
            )
        return
    if settings.is_guidance_distilled is True:
        return
    why = None
    if not runs_branch_views:
        why = "this model's guidance runs every branch in one forward"
    elif req.params.skip_guidance_layers:
        why = "skip-layer guidance reads both branches at every guided step"
    if why is not None:
        raise InvalidRequestError(
            f"cache: fastercache cannot skip this request's negative-prompt branch ({why}): set "
            "is_guidance_distilled true to reuse attention on every branch, or pass another method",
            param="cache",
        )
