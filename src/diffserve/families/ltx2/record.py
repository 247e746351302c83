"""The LTX-2 family's records: text-to-video and image-to-video with a soundtrack (`LTX2Pipeline`,
`LTX2ImageToVideoPipeline`): the joint audio-video DiT, its text connectors, both VAEs and the vocoder."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from diffserve.families.ltx2.pipeline import LTX2ImageToVideoPipeline, LTX2Pipeline
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.ltx2 import LTX2VideoTransformer3DModel
from diffserve.models.dits.ltx2_connectors import LTX2TextConnectors
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffserve.models.vaes.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio
from diffserve.models.vaes.ltx2_vocoder import LTX2Vocoder, LTX2VocoderWithBWE

#: The tiny builder (it needs diffusers installed); each record names its variant of the spec.
_tiny = partial(lazy_tiny_builder, "diffserve.families.ltx2.tiny", "build_tiny_ltx2", "TinyLTX2Spec")

_CLASSES = NativeClasses.of(
    models=(
        LTX2VideoTransformer3DModel, LTX2TextConnectors, AutoencoderKLLTX2Video, AutoencoderKLLTX2Audio,
        LTX2Vocoder, LTX2VocoderWithBWE,
    ),
    schedulers=(FlowMatchEulerScheduler,),
    encoders=("Gemma3ForConditionalGeneration",),
)  # fmt: skip
#: No quantization, LoRA or single-file support yet: the loader refuses them naming the DiT.
_DIT_FACTS = DitFacts(class_name=LTX2VideoTransformer3DModel.diffusers_class_name)

_LTX2_T2V = ModelFamily(
    name="ltx2-t2v",
    diffusers_pipeline="LTX2Pipeline",
    pipeline_cls=LTX2Pipeline,
    native_classes=_CLASSES,
    task="text-to-video",  # with its soundtrack
    tiny_builder=_tiny(image_to_video=False),
    dit_facts=_DIT_FACTS,
    aliases=("ltx2", "ltx-2"),
)

FAMILIES: tuple[ModelFamily, ...] = (
    _LTX2_T2V,
    replace(
        _LTX2_T2V,
        name="ltx2-i2v",
        diffusers_pipeline="LTX2ImageToVideoPipeline",
        pipeline_cls=LTX2ImageToVideoPipeline,
        task="image-to-video",  # with its soundtrack
        tiny_builder=_tiny(image_to_video=True),
        aliases=(),
    ),
)
