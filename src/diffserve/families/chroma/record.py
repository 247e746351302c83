"""The Chroma family's record: text-to-image (`ChromaPipeline`) on the Chroma DiT, FLUX.1's VAE and
scheduler, and T5."""

from __future__ import annotations

from pathlib import Path

from diffserve.families.chroma.pipeline import ChromaPipeline
from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.loader.dit_facts import DitFacts, LoraFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.chroma import ChromaTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL


def _tiny_chroma(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    """Imports its module when called (transformers model classes the registry does not need)."""
    from diffserve.families.chroma.tiny import TinyChromaSpec, build_tiny_chroma

    return build_tiny_chroma(out_dir, TinyChromaSpec(seed=options.seed))


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
        tiny_builder=_tiny_chroma,
        # LoRA adapters and single files are not supported yet (refused by name).
        dit_facts=DitFacts(
            class_name=ChromaTransformer2DModel.diffusers_class_name,
            full_precision_modules=frozenset(
                {"distilled_guidance_layer", "context_embedder", "x_embedder", "proj_out"}
            ),
            # Diffusers/PEFT-format files (ChromaPipeline's loader passes their alphas as FLUX's does).
            lora=LoraFacts(components=("transformer",), first_alpha_fill=True),
        ),
    ),
)
