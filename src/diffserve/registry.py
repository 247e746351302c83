"""The model families diffserve serves, one `ModelFamily` record each. Code that needs a family's
classes, names or builders reads them from here instead of listing families itself.

A record says everything the rest of the engine needs to know about a family: the Diffusers pipeline
`_class_name` it serves (no guessing from folder or model names: a folder is served only when its
model_index.json names a pipeline listed here, and anything else is refused with the list of what is
supported), its pipeline class, the native classes that implement its Diffusers components, its
pipeline config and sampling defaults, its task, its quality tiers, and the builder of its tiny
random-weight checkpoint (`diffserve make-tiny`). Its `name` is the family's one spelling everywhere
(CLI, calibration files, logs); `aliases` are other spellings accepted on input, and only
`family_by_name` reads them.

Adding a family: its DiT (and VAE, if new) under `models/`, its pipeline under `pipelines/` with its
config under `configs/` (and any stage only it uses, as `stages/<family>_*.py`), its tiny builder under
`testing/`, its record here, and its parity test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from diffserve.configs.flux import (
    FluxFillPipelineConfig,
    FluxKontextPipelineConfig,
    FluxPipelineConfig,
    flux_default_sampling_params,
    flux_fill_default_sampling_params,
)
from diffserve.configs.flux2 import (
    Flux2KleinPipelineConfig,
    Flux2PipelineConfig,
    flux2_default_sampling_params,
    flux2_klein_default_sampling_params,
)
from diffserve.configs.hunyuan_video15 import (
    HunyuanVideo15PipelineConfig,
    hunyuan_video15_default_sampling_params,
)
from diffserve.configs.ltx2 import LTX2PipelineConfig, ltx2_default_sampling_params
from diffserve.configs.qwen_image import (
    QwenImageEditPipelineConfig,
    QwenImageEditPlusPipelineConfig,
    QwenImagePipelineConfig,
    qwen_image_default_sampling_params,
)
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.sana import (
    SanaPipelineConfig,
    SanaSprintPipelineConfig,
    sana_default_sampling_params,
    sana_sprint_default_sampling_params,
)
from diffserve.configs.sd3 import SD3PipelineConfig, sd3_default_sampling_params
from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.configs.wan import WanPipelineConfig, wan_default_sampling_params
from diffserve.configs.z_image import ZImagePipelineConfig, z_image_default_sampling_params
from diffserve.errors import ModelLoadError, UserError
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.dits.flux2 import Flux2Transformer2DModel
from diffserve.models.dits.hunyuan_video15 import HunyuanVideo15Transformer3DModel
from diffserve.models.dits.ltx2 import LTX2VideoTransformer3DModel
from diffserve.models.dits.ltx2_connectors import LTX2TextConnectors
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.dits.sana import SanaTransformer2DModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.models.guiders.classifier_free_guidance import ClassifierFreeGuidance
from diffserve.models.schedulers.dpm_solver_flow import DPMSolverFlowScheduler
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.scm import SCMScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.models.vaes.autoencoder_dc import AutoencoderDC
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffserve.models.vaes.autoencoder_kl_hunyuan_video15 import AutoencoderKLHunyuanVideo15
from diffserve.models.vaes.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffserve.models.vaes.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio
from diffserve.models.vaes.autoencoder_kl_qwen_image import AutoencoderKLQwenImage
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.models.vaes.ltx2_vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from diffserve.pipelines.base import Pipeline
from diffserve.pipelines.flux import FluxPipeline
from diffserve.pipelines.flux2 import Flux2KleinPipeline, Flux2Pipeline
from diffserve.pipelines.flux_fill import FluxFillPipeline
from diffserve.pipelines.flux_kontext import FluxKontextPipeline
from diffserve.pipelines.hunyuan_video15 import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffserve.pipelines.ltx2 import LTX2ImageToVideoPipeline, LTX2Pipeline
from diffserve.pipelines.qwen_image import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffserve.pipelines.sana import SanaPipeline, SanaSprintPipeline
from diffserve.pipelines.sd3 import SD3Pipeline
from diffserve.pipelines.wan import WanImageToVideoPipeline, WanPipeline
from diffserve.pipelines.z_image import ZImagePipeline


@dataclass(frozen=True)
class TinyCheckpointOptions:
    """What `diffserve make-tiny` hands a family's tiny-checkpoint builder. Every builder reads `seed`;
    the other fields are variants of one family each, and other families' builders ignore them."""

    seed: int = 0
    #: FLUX: False writes a FLUX.1-schnell style DiT (no guidance embedding).
    guidance_embeds: bool = True
    #: SD3: write the SD3.5 layout (qk RMSNorm, dual attention in block 0).
    sd35: bool = False
    #: Wan: the scheduler written, "flow-match-euler" or "unipc" (what the released Wan 2.1 folders ship).
    scheduler: str = "flow-match-euler"
    #: Wan: "2.1", "2.2-a14b" (two experts) or "2.2-ti2v" (Wan 2.2 VAE, T2V and I2V in one wan-t2v folder).
    wan_variant: str = "2.1"


class TinyCheckpointBuilder(Protocol):
    """Writes a small random-weight checkpoint of one family in Diffusers layout to `out_dir` (created if
    missing) and returns the folder's path."""

    def __call__(self, out_dir: Path, options: TinyCheckpointOptions) -> Path: ...


@dataclass(frozen=True)
class ModelFamily:
    """One model family: everything diffserve needs to load, serve and test it."""

    #: The family's one spelling (CLI, calibration files, logs, metrics).
    name: str
    #: The Diffusers pipeline `_class_name` in model_index.json that this family serves.
    diffusers_pipeline: str
    pipeline_cls: type[Pipeline]
    #: Diffusers `_class_name` -> native class, for the DiT, the VAE and the schedulers this family loads.
    native_classes: NativeClasses
    #: The family's pipeline constants (a dataclass of `configs/<family>.py`).
    pipeline_config: object
    default_sampling_params: Callable[[], SamplingParams]
    #: What it makes from what: "text-to-image", "image-edit", "text-to-video", "image-to-video".
    task: str
    #: Writes the family's tiny random-weight checkpoint (what `diffserve make-tiny NAME DIR` runs).
    tiny_builder: TinyCheckpointBuilder
    #: Other spellings of `name` accepted on input (resolved by `family_by_name` only).
    aliases: tuple[str, ...] = ()

    @property
    def step_cache_policies(self) -> Mapping[str, StepCachePolicy]:
        """The approximate quality tiers the family serves with their default step-cache thresholds (empty:
        only "high", the exact path). They are measured per pipeline, so they live on the pipeline class; a model
        folder's calibration file overrides them (`configs/quality.py`)."""
        return self.pipeline_cls.step_cache_policies


# --- Tiny checkpoint builders. Each imports its `testing/` module when called: those modules import
# transformers model classes that loading the registry (every engine start) does not need.


def _tiny_flux(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    from diffserve.testing.tiny_flux import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(out_dir, TinyFluxSpec(seed=options.seed, guidance_embeds=options.guidance_embeds))


def _tiny_flux_kontext(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    from diffserve.testing.tiny_flux import TinyFluxSpec
    from diffserve.testing.tiny_flux_kontext import build_tiny_flux_kontext

    return build_tiny_flux_kontext(
        out_dir, TinyFluxSpec(seed=options.seed, guidance_embeds=options.guidance_embeds)
    )


def _tiny_flux_fill(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    from diffserve.testing.tiny_flux import TinyFluxSpec
    from diffserve.testing.tiny_flux_fill import build_tiny_flux_fill

    return build_tiny_flux_fill(
        out_dir, TinyFluxSpec(seed=options.seed, guidance_embeds=options.guidance_embeds)
    )


def _tiny_sana(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    from diffserve.testing.tiny_sana import TinySanaSpec, build_tiny_sana

    return build_tiny_sana(out_dir, TinySanaSpec(seed=options.seed))


def _tiny_sana_sprint(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    from diffserve.testing.tiny_sana import TinySanaSpec, build_tiny_sana

    return build_tiny_sana(out_dir, TinySanaSpec(seed=options.seed, sprint=True, sample_size=32))


def _tiny_flux2(variant: str) -> TinyCheckpointBuilder:
    """The builder of a FLUX.2-dev ("dev") or FLUX.2 [klein] ("klein") folder."""

    def build(out_dir: Path, options: TinyCheckpointOptions) -> Path:
        from diffserve.testing.tiny_flux2 import TinyFlux2Spec, build_tiny_flux2

        return build_tiny_flux2(out_dir, TinyFlux2Spec(variant=variant, seed=options.seed))

    return build


def _tiny_sd3(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    from diffserve.testing.tiny_sd3 import TinySD3Spec, build_tiny_sd3

    if options.sd35:
        return build_tiny_sd3(
            out_dir, TinySD3Spec(seed=options.seed, qk_norm="rms_norm", dual_attention_layers=(0,))
        )
    return build_tiny_sd3(out_dir, TinySD3Spec(seed=options.seed))


def _tiny_qwen_image(variant: str) -> TinyCheckpointBuilder:
    """The builder of one Qwen-Image folder kind ("t2i", "edit" or "edit_plus")."""

    def build(out_dir: Path, options: TinyCheckpointOptions) -> Path:
        from diffserve.testing.tiny_qwen_image import TinyQwenImageSpec, build_tiny_qwen_image

        return build_tiny_qwen_image(out_dir, TinyQwenImageSpec(variant=variant, seed=options.seed))

    return build


def _tiny_z_image(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    from diffserve.testing.tiny_zimage import TinyZImageSpec, build_tiny_zimage

    return build_tiny_zimage(out_dir, TinyZImageSpec(seed=options.seed))


def _tiny_wan(image_to_video: bool) -> TinyCheckpointBuilder:
    """The builder of a Wan text-to-video or image-to-video folder (Wan 2.1, or `options.wan_variant`)."""

    def build(out_dir: Path, options: TinyCheckpointOptions) -> Path:
        from diffserve.testing.tiny_wan import TinyWanSpec, build_tiny_wan

        spec = TinyWanSpec(
            image_to_video=image_to_video,
            scheduler=options.scheduler,
            seed=options.seed,
            variant=options.wan_variant,
        )
        return build_tiny_wan(out_dir, spec)

    return build


def _tiny_hunyuan_video15(image_to_video: bool) -> TinyCheckpointBuilder:
    """The builder of a HunyuanVideo 1.5 text-to-video or image-to-video folder (needs diffusers installed)."""

    def build(out_dir: Path, options: TinyCheckpointOptions) -> Path:
        from diffserve.testing.tiny_hunyuan_video15 import TinyHunyuanVideo15Spec, build_tiny_hunyuan_video15

        spec = TinyHunyuanVideo15Spec(image_to_video=image_to_video, seed=options.seed)
        return build_tiny_hunyuan_video15(out_dir, spec)

    return build


def _tiny_ltx2(image_to_video: bool) -> TinyCheckpointBuilder:
    """The builder of an LTX-2 text-to-video or image-to-video folder (needs diffusers installed)."""

    def build(out_dir: Path, options: TinyCheckpointOptions) -> Path:
        from diffserve.testing.tiny_ltx2 import TinyLTX2Spec, build_tiny_ltx2

        return build_tiny_ltx2(out_dir, TinyLTX2Spec(image_to_video=image_to_video, seed=options.seed))

    return build


# --- the families --------------------------------------------------------------------------------

_FLOW_MATCH = (FlowMatchEulerScheduler,)
_FLUX_CLASSES = NativeClasses.of(models=(FluxTransformer2DModel, AutoencoderKL), schedulers=_FLOW_MATCH)
_FLUX2_CLASSES = NativeClasses.of(
    models=(Flux2Transformer2DModel, AutoencoderKLFlux2), schedulers=_FLOW_MATCH
)
_QWEN_IMAGE_CLASSES = NativeClasses.of(
    models=(QwenImageTransformer2DModel, AutoencoderKLQwenImage), schedulers=_FLOW_MATCH
)
_HUNYUAN_VIDEO15_CLASSES = NativeClasses.of(
    models=(HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15),
    schedulers=_FLOW_MATCH,
    guiders=(ClassifierFreeGuidance,),
)
_LTX2_CLASSES = NativeClasses.of(
    models=(
        LTX2VideoTransformer3DModel, LTX2TextConnectors, AutoencoderKLLTX2Video, AutoencoderKLLTX2Audio,
        LTX2Vocoder, LTX2VocoderWithBWE,
    ),
    schedulers=_FLOW_MATCH,
)  # fmt: skip
_WAN_CLASSES = NativeClasses.of(
    models=(WanTransformer3DModel, AutoencoderKLWan), schedulers=(UniPCFlowScheduler, FlowMatchEulerScheduler)
)

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="flux",
        diffusers_pipeline="FluxPipeline",
        pipeline_cls=FluxPipeline,
        native_classes=_FLUX_CLASSES,
        pipeline_config=FluxPipelineConfig(),
        default_sampling_params=flux_default_sampling_params,
        task="text-to-image",
        tiny_builder=_tiny_flux,
    ),
    ModelFamily(
        name="sd3",
        diffusers_pipeline="StableDiffusion3Pipeline",
        pipeline_cls=SD3Pipeline,
        native_classes=NativeClasses.of(
            models=(SD3Transformer2DModel, AutoencoderKL), schedulers=_FLOW_MATCH
        ),
        pipeline_config=SD3PipelineConfig(),
        default_sampling_params=sd3_default_sampling_params,
        task="text-to-image",
        tiny_builder=_tiny_sd3,
    ),
    ModelFamily(
        name="qwen-image",
        diffusers_pipeline="QwenImagePipeline",
        pipeline_cls=QwenImagePipeline,
        native_classes=_QWEN_IMAGE_CLASSES,
        pipeline_config=QwenImagePipelineConfig(),
        default_sampling_params=qwen_image_default_sampling_params,
        task="text-to-image",
        tiny_builder=_tiny_qwen_image("t2i"),
    ),
    ModelFamily(
        name="qwen-image-edit",
        diffusers_pipeline="QwenImageEditPipeline",
        pipeline_cls=QwenImageEditPipeline,
        native_classes=_QWEN_IMAGE_CLASSES,
        pipeline_config=QwenImageEditPipelineConfig(),
        default_sampling_params=qwen_image_default_sampling_params,
        task="image-edit",
        tiny_builder=_tiny_qwen_image("edit"),
    ),
    ModelFamily(
        name="qwen-image-edit-plus",
        diffusers_pipeline="QwenImageEditPlusPipeline",
        pipeline_cls=QwenImageEditPlusPipeline,
        native_classes=_QWEN_IMAGE_CLASSES,
        pipeline_config=QwenImageEditPlusPipelineConfig(),
        default_sampling_params=qwen_image_default_sampling_params,
        task="image-edit",
        tiny_builder=_tiny_qwen_image("edit_plus"),
    ),
    ModelFamily(
        name="z-image",
        diffusers_pipeline="ZImagePipeline",
        pipeline_cls=ZImagePipeline,
        native_classes=NativeClasses.of(
            models=(ZImageTransformer2DModel, AutoencoderKL), schedulers=_FLOW_MATCH
        ),
        pipeline_config=ZImagePipelineConfig(),
        default_sampling_params=z_image_default_sampling_params,
        task="text-to-image",
        tiny_builder=_tiny_z_image,
        aliases=("zimage", "z_image"),
    ),
    ModelFamily(
        name="wan-t2v",
        diffusers_pipeline="WanPipeline",
        pipeline_cls=WanPipeline,
        native_classes=_WAN_CLASSES,
        pipeline_config=WanPipelineConfig(),
        default_sampling_params=wan_default_sampling_params,
        task="text-to-video",
        tiny_builder=_tiny_wan(image_to_video=False),
    ),
    ModelFamily(
        name="wan-i2v",
        diffusers_pipeline="WanImageToVideoPipeline",
        pipeline_cls=WanImageToVideoPipeline,
        native_classes=_WAN_CLASSES,
        pipeline_config=WanPipelineConfig(),
        default_sampling_params=wan_default_sampling_params,
        task="image-to-video",
        tiny_builder=_tiny_wan(image_to_video=True),
    ),
    ModelFamily(
        name="flux-kontext",
        diffusers_pipeline="FluxKontextPipeline",
        pipeline_cls=FluxKontextPipeline,
        native_classes=_FLUX_CLASSES,
        pipeline_config=FluxKontextPipelineConfig(),
        default_sampling_params=flux_default_sampling_params,
        task="image-edit",
        tiny_builder=_tiny_flux_kontext,
        aliases=("kontext", "flux_kontext"),
    ),
    ModelFamily(
        name="flux-fill",
        diffusers_pipeline="FluxFillPipeline",
        pipeline_cls=FluxFillPipeline,
        native_classes=_FLUX_CLASSES,
        pipeline_config=FluxFillPipelineConfig(),
        default_sampling_params=flux_fill_default_sampling_params,
        task="image-edit",
        tiny_builder=_tiny_flux_fill,
        aliases=("flux_fill",),
    ),
    ModelFamily(
        name="sana",
        diffusers_pipeline="SanaPipeline",
        pipeline_cls=SanaPipeline,
        native_classes=NativeClasses.of(
            models=(SanaTransformer2DModel, AutoencoderDC),
            # What SANA's folders ship (flow DPM-Solver++), and the flow-match Euler its converter also writes.
            schedulers=(DPMSolverFlowScheduler, FlowMatchEulerScheduler),
        ),
        pipeline_config=SanaPipelineConfig(),
        default_sampling_params=sana_default_sampling_params,
        task="text-to-image",
        tiny_builder=_tiny_sana,
    ),
    ModelFamily(
        name="sana-sprint",
        diffusers_pipeline="SanaSprintPipeline",
        pipeline_cls=SanaSprintPipeline,
        native_classes=NativeClasses.of(
            models=(SanaTransformer2DModel, AutoencoderDC), schedulers=(SCMScheduler,)
        ),
        pipeline_config=SanaSprintPipelineConfig(),
        default_sampling_params=sana_sprint_default_sampling_params,
        task="text-to-image",
        tiny_builder=_tiny_sana_sprint,
        aliases=("sana_sprint",),
    ),
    ModelFamily(
        name="flux2",
        diffusers_pipeline="Flux2Pipeline",
        pipeline_cls=Flux2Pipeline,
        native_classes=_FLUX2_CLASSES,
        pipeline_config=Flux2PipelineConfig(),
        default_sampling_params=flux2_default_sampling_params,
        task="text-to-image",  # with optional reference images (multi-reference editing)
        tiny_builder=_tiny_flux2("dev"),
        aliases=("flux2-dev", "flux.2"),
    ),
    ModelFamily(
        name="flux2-klein",
        diffusers_pipeline="Flux2KleinPipeline",
        pipeline_cls=Flux2KleinPipeline,
        native_classes=_FLUX2_CLASSES,
        pipeline_config=Flux2KleinPipelineConfig(),
        default_sampling_params=flux2_klein_default_sampling_params,
        task="text-to-image",  # with optional reference images (multi-reference editing)
        tiny_builder=_tiny_flux2("klein"),
        aliases=("flux2_klein", "klein"),
    ),
    ModelFamily(
        name="hunyuan-video15-t2v",
        diffusers_pipeline="HunyuanVideo15Pipeline",
        pipeline_cls=HunyuanVideo15Pipeline,
        native_classes=_HUNYUAN_VIDEO15_CLASSES,
        pipeline_config=HunyuanVideo15PipelineConfig(),
        default_sampling_params=hunyuan_video15_default_sampling_params,
        task="text-to-video",
        tiny_builder=_tiny_hunyuan_video15(image_to_video=False),
        aliases=("hunyuan-video15", "hunyuanvideo15-t2v"),
    ),
    ModelFamily(
        name="hunyuan-video15-i2v",
        diffusers_pipeline="HunyuanVideo15ImageToVideoPipeline",
        pipeline_cls=HunyuanVideo15ImageToVideoPipeline,
        native_classes=_HUNYUAN_VIDEO15_CLASSES,
        pipeline_config=HunyuanVideo15PipelineConfig(),
        default_sampling_params=hunyuan_video15_default_sampling_params,
        task="image-to-video",
        tiny_builder=_tiny_hunyuan_video15(image_to_video=True),
        aliases=("hunyuanvideo15-i2v",),
    ),
    ModelFamily(
        name="ltx2-t2v",
        diffusers_pipeline="LTX2Pipeline",
        pipeline_cls=LTX2Pipeline,
        native_classes=_LTX2_CLASSES,
        pipeline_config=LTX2PipelineConfig(),
        default_sampling_params=ltx2_default_sampling_params,
        task="text-to-video",  # with its soundtrack
        tiny_builder=_tiny_ltx2(image_to_video=False),
        aliases=("ltx2", "ltx-2"),
    ),
    ModelFamily(
        name="ltx2-i2v",
        diffusers_pipeline="LTX2ImageToVideoPipeline",
        pipeline_cls=LTX2ImageToVideoPipeline,
        native_classes=_LTX2_CLASSES,
        pipeline_config=LTX2PipelineConfig(),
        default_sampling_params=ltx2_default_sampling_params,
        task="image-to-video",  # with its soundtrack
        tiny_builder=_tiny_ltx2(image_to_video=True),
    ),
)

#: Diffusers pipeline `_class_name` -> family.
REGISTRY: dict[str, ModelFamily] = {family.diffusers_pipeline: family for family in FAMILIES}

_BY_NAME: dict[str, ModelFamily] = {
    spelling: family for family in FAMILIES for spelling in (family.name, *family.aliases)
}


def family_names() -> tuple[str, ...]:
    """Every family's name, in registry order (aliases not included)."""
    return tuple(family.name for family in FAMILIES)


def family_by_name(name: str) -> ModelFamily:
    """The family with this name or alias (`zimage` -> `z-image`), or a UserError listing the names."""
    family = _BY_NAME.get(name)
    if family is None:
        raise UserError(f"unknown model family {name!r}; families: {', '.join(family_names())}")
    return family


def resolve_family(pipeline_class_name: str) -> ModelFamily:
    """The family for a Diffusers pipeline class name, or a ModelLoadError listing the supported ones."""
    family = REGISTRY.get(pipeline_class_name)
    if family is None:
        supported = ", ".join(sorted(REGISTRY))
        raise ModelLoadError(
            f"pipeline {pipeline_class_name!r} is not supported by diffserve's native backend; "
            f"supported pipelines: {supported}. To run it through diffusers' own pipeline instead (one request "
            'at a time, exact quality only), pass --backend diffusers (backend="diffusers" in the Python API; '
            "needs pip install 'diffserve[diffusers]')"
        )
    return family
