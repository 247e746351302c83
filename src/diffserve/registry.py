"""Explicit table from a Diffusers pipeline `_class_name` to diffserve's model family.

No guessing from folder or model names: a folder is served only when its model_index.json names
a pipeline listed here, and anything else is refused with the list of what is supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diffserve.configs.flux import FluxPipelineConfig, flux_default_sampling_params
from diffserve.configs.qwen_image import (
    QwenImageEditPipelineConfig,
    QwenImageEditPlusPipelineConfig,
    QwenImagePipelineConfig,
    qwen_image_default_sampling_params,
)
from diffserve.configs.sampling_params import SamplingParams
from diffserve.configs.sd3 import SD3PipelineConfig, sd3_default_sampling_params
from diffserve.configs.wan import WanPipelineConfig, wan_default_sampling_params
from diffserve.configs.z_image import ZImagePipelineConfig, z_image_default_sampling_params
from diffserve.errors import ModelLoadError
from diffserve.pipelines.base import Pipeline
from diffserve.pipelines.flux import FluxPipeline
from diffserve.pipelines.qwen_image import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffserve.pipelines.sd3 import SD3Pipeline
from diffserve.pipelines.wan import WanImageToVideoPipeline, WanPipeline
from diffserve.pipelines.z_image import ZImagePipeline


@dataclass(frozen=True)
class ModelFamily:
    name: str
    diffusers_pipeline: str
    pipeline_cls: type[Pipeline]
    pipeline_config: object
    default_sampling_params: Callable[[], SamplingParams]
    task: str  # "text-to-image", "image-to-image", "text-to-video", ...


REGISTRY: dict[str, ModelFamily] = {
    "FluxPipeline": ModelFamily(
        name="flux",
        diffusers_pipeline="FluxPipeline",
        pipeline_cls=FluxPipeline,
        pipeline_config=FluxPipelineConfig(),
        default_sampling_params=flux_default_sampling_params,
        task="text-to-image",
    ),
    "StableDiffusion3Pipeline": ModelFamily(
        name="sd3",
        diffusers_pipeline="StableDiffusion3Pipeline",
        pipeline_cls=SD3Pipeline,
        pipeline_config=SD3PipelineConfig(),
        default_sampling_params=sd3_default_sampling_params,
        task="text-to-image",
    ),
    "QwenImagePipeline": ModelFamily(
        name="qwen-image",
        diffusers_pipeline="QwenImagePipeline",
        pipeline_cls=QwenImagePipeline,
        pipeline_config=QwenImagePipelineConfig(),
        default_sampling_params=qwen_image_default_sampling_params,
        task="text-to-image",
    ),
    "QwenImageEditPipeline": ModelFamily(
        name="qwen-image-edit",
        diffusers_pipeline="QwenImageEditPipeline",
        pipeline_cls=QwenImageEditPipeline,
        pipeline_config=QwenImageEditPipelineConfig(),
        default_sampling_params=qwen_image_default_sampling_params,
        task="image-edit",
    ),
    "QwenImageEditPlusPipeline": ModelFamily(
        name="qwen-image-edit-plus",
        diffusers_pipeline="QwenImageEditPlusPipeline",
        pipeline_cls=QwenImageEditPlusPipeline,
        pipeline_config=QwenImageEditPlusPipelineConfig(),
        default_sampling_params=qwen_image_default_sampling_params,
        task="image-edit",
    ),
    "ZImagePipeline": ModelFamily(
        name="z-image",
        diffusers_pipeline="ZImagePipeline",
        pipeline_cls=ZImagePipeline,
        pipeline_config=ZImagePipelineConfig(),
        default_sampling_params=z_image_default_sampling_params,
        task="text-to-image",
    ),
    "WanPipeline": ModelFamily(
        name="wan-t2v",
        diffusers_pipeline="WanPipeline",
        pipeline_cls=WanPipeline,
        pipeline_config=WanPipelineConfig(),
        default_sampling_params=wan_default_sampling_params,
        task="text-to-video",
    ),
    "WanImageToVideoPipeline": ModelFamily(
        name="wan-i2v",
        diffusers_pipeline="WanImageToVideoPipeline",
        pipeline_cls=WanImageToVideoPipeline,
        pipeline_config=WanPipelineConfig(),
        default_sampling_params=wan_default_sampling_params,
        task="image-to-video",
    ),
}


def resolve_family(pipeline_class_name: str) -> ModelFamily:
    """The family for a Diffusers pipeline class name, or a ModelLoadError listing the supported ones."""
    family = REGISTRY.get(pipeline_class_name)
    if family is None:
        supported = ", ".join(sorted(REGISTRY))
        raise ModelLoadError(
            f"pipeline {pipeline_class_name!r} is not supported by diffserve; supported pipelines: {supported}"
        )
    return family
