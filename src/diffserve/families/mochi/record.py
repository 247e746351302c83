"""The Mochi family's record: text-to-video (`MochiPipeline`, Mochi 1): T5 text, Mochi's asymmetric joint DiT
on its VAE's latents, flow-matching Euler steps over Mochi's linear-quadratic sigmas."""

from __future__ import annotations

from pathlib import Path

from diffserve.families.mochi.pipeline import MochiPipeline
from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.loader.dit_facts import DitFacts, LoraFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.mochi import MochiTransformer3DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_mochi import AutoencoderKLMochi


def _tiny_mochi(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    """Imports its module when called (transformers model classes the registry does not need)."""
    from diffserve.families.mochi.tiny import TinyMochiSpec, build_tiny_mochi

    return build_tiny_mochi(out_dir, TinyMochiSpec(seed=options.seed))


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="mochi",
        diffusers_pipeline="MochiPipeline",
        pipeline_cls=MochiPipeline,
        native_classes=NativeClasses.of(
            models=(MochiTransformer3DModel, AutoencoderKLMochi),
            schedulers=(FlowMatchEulerScheduler,),
            encoders=("T5EncoderModel",),
        ),
        task="text-to-video",
        tiny_builder=_tiny_mochi,
        dit_facts=DitFacts(
            class_name=MochiTransformer3DModel.diffusers_class_name,
            # The patch embedder, the timestep and caption embedders (with the attention pooler), the head.
            full_precision_modules=frozenset({"patch_embed", "time_embed", "norm_out", "proj_out"}),
            # Diffusers' `Mochi1LoraLoaderMixin` converts no other layout: Diffusers/PEFT files only.
            lora=LoraFacts(),
            # No single-file support yet: the loader refuses it naming the DiT.
        ),
        aliases=("mochi-1", "mochi1"),
    ),
)
