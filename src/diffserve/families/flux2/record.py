"""The FLUX.2 family's records: FLUX.2 [dev] (`Flux2Pipeline`, Mistral-3 text) and FLUX.2 [klein]
(`Flux2KleinPipeline`, Qwen3 text), both text-to-image with optional reference images."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from diffserve.families.flux2.pipeline import Flux2KleinPipeline, Flux2Pipeline
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.flux2 import Flux2Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2

#: The tiny builder; each record names its variant of the spec.
_tiny = partial(lazy_tiny_builder, "diffserve.families.flux2.tiny", "build_tiny_flux2", "TinyFlux2Spec")

_CLASSES = NativeClasses.of(
    models=(Flux2Transformer2DModel, AutoencoderKLFlux2),
    schedulers=(FlowMatchEulerScheduler,),
    encoders=("Mistral3ForConditionalGeneration", "Qwen3ForCausalLM"),
)
#: No quantization, LoRA or single-file support yet: the loader refuses them naming the DiT.
_DIT_FACTS = DitFacts(class_name=Flux2Transformer2DModel.diffusers_class_name)

_FLUX2 = ModelFamily(
    name="flux2",
    diffusers_pipeline="Flux2Pipeline",
    pipeline_cls=Flux2Pipeline,
    native_classes=_CLASSES,
    task="text-to-image",  # with optional reference images (multi-reference editing)
    tiny_builder=_tiny(variant="dev"),
    dit_facts=_DIT_FACTS,
    aliases=("flux2-dev", "flux.2"),
)

FAMILIES: tuple[ModelFamily, ...] = (
    _FLUX2,
    replace(
        _FLUX2,
        name="flux2-klein",
        diffusers_pipeline="Flux2KleinPipeline",
        pipeline_cls=Flux2KleinPipeline,
        tiny_builder=_tiny(variant="klein"),
        aliases=("flux2_klein", "klein"),
    ),
)
