"""The Chroma family's record: text-to-image (`ChromaPipeline`) on the Chroma DiT, FLUX.1's VAE and
scheduler, and T5."""

from __future__ import annotations

from diffserve.families.chroma.pipeline import ChromaPipeline
from diffserve.families.chroma.single_file_keys import chroma_plan
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.chroma import ChromaTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="chroma",
        diffusers_pipeline="ChromaPipeline",
        pipeline_cls=ChromaPipeline,
        native_classes=NativeClasses.of(
            models=(ChromaTransformer2DModel, AutoencoderKL),
            schedulers=(FlowMatchEulerScheduler,),
            encoders=("T5EncoderModel",),
        ),
        task="text-to-image",
        tiny_builder=lazy_tiny_builder(
            "diffserve.families.chroma.tiny", "build_tiny_chroma", "TinyChromaSpec"
        ),
        dit_facts=DitFacts(
            class_name=ChromaTransformer2DModel.diffusers_class_name,
            full_precision_modules=frozenset(
                {"distilled_guidance_layer", "context_embedder", "x_embedder", "proj_out"}
            ),
            # Diffusers/PEFT-format files (ChromaPipeline's loader passes their alphas as FLUX's does).
            lora=LoraFacts(components=("transformer",), first_alpha_fill=True),
            # Original-name files (FLUX.1's BFL names and the guidance approximator); city96's GGUF files of
            # Chroma say "chroma".
            single_file=SingleFileKeys(
                "Chroma", chroma_plan, gguf_arches=("chroma",), markers=("distilled_guidance_layer.",)
            ),
        ),
    ),
)
