"""The HunyuanVideo 1.5 family's records: text-to-video (`HunyuanVideo15Pipeline`) and image-to-video
(`HunyuanVideo15ImageToVideoPipeline`), with its classifier-free-guidance guider component."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from diffserve.families.hunyuan_video15.pipeline import (
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
)
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.hunyuan_video15 import HunyuanVideo15Transformer3DModel
from diffserve.models.guiders.classifier_free_guidance import ClassifierFreeGuidance
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_hunyuan_video15 import AutoencoderKLHunyuanVideo15

#: The tiny builder (it needs diffusers installed); each record names its variant of the spec.
_tiny = partial(
    lazy_tiny_builder,
    "diffserve.families.hunyuan_video15.tiny",
    "build_tiny_hunyuan_video15",
    "TinyHunyuanVideo15Spec",
)

_CLASSES = NativeClasses.of(
    models=(HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15),
    schedulers=(FlowMatchEulerScheduler,),
    guiders=(ClassifierFreeGuidance,),
    encoders=("Qwen2_5_VLTextModel", "T5EncoderModel", "SiglipVisionModel"),
)
#: No quantization, LoRA or single-file support yet: the loader refuses them naming the DiT.
_DIT_FACTS = DitFacts(class_name=HunyuanVideo15Transformer3DModel.diffusers_class_name)

_HUNYUAN_VIDEO15_T2V = ModelFamily(
    name="hunyuan-video15-t2v",
    diffusers_pipeline="HunyuanVideo15Pipeline",
    pipeline_cls=HunyuanVideo15Pipeline,
    native_classes=_CLASSES,
    task="text-to-video",
    tiny_builder=_tiny(image_to_video=False),
    dit_facts=_DIT_FACTS,
    aliases=("hunyuan-video15", "hunyuanvideo15-t2v"),
)

FAMILIES: tuple[ModelFamily, ...] = (
    _HUNYUAN_VIDEO15_T2V,
    replace(
        _HUNYUAN_VIDEO15_T2V,
        name="hunyuan-video15-i2v",
        diffusers_pipeline="HunyuanVideo15ImageToVideoPipeline",
        pipeline_cls=HunyuanVideo15ImageToVideoPipeline,
        task="image-to-video",
        tiny_builder=_tiny(image_to_video=True),
        aliases=("hunyuanvideo15-i2v",),
    ),
)
