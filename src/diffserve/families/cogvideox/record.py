"""The CogVideoX family's records: text-to-video (`CogVideoXPipeline`) and image-to-video
(`CogVideoXImageToVideoPipeline`), CogVideoX 1.0 and 1.5, sharing the CogVideoX DiT's facts: its joint
text-video DiT on CogVideoX's causal VAE latents, sampled by the DDIM or DPM scheduler the folder names."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

from diffserve.families.cogvideox.pipeline import CogVideoXImageToVideoPipeline, CogVideoXPipeline
from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.loader.dit_facts import DitFacts, LoraFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel
from diffserve.models.schedulers.cogvideox_ddim import CogVideoXDDIMScheduler, CogVideoXDPMScheduler
from diffserve.models.vaes.autoencoder_kl_cogvideox import AutoencoderKLCogVideoX


def _tiny_cogvideox(out_dir: Path, options: TinyCheckpointOptions, image_to_video: bool) -> Path:
    """Imports its module when called (transformers model classes the registry does not need)."""
    from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox

    return build_tiny_cogvideox(out_dir, TinyCogVideoXSpec(image_to_video=image_to_video, seed=options.seed))


_T2V = ModelFamily(
    name="cogvideox-t2v",
    diffusers_pipeline="CogVideoXPipeline",
    pipeline_cls=CogVideoXPipeline,
    native_classes=NativeClasses.of(
        models=(CogVideoXTransformer3DModel, AutoencoderKLCogVideoX),
        schedulers=(CogVideoXDDIMScheduler, CogVideoXDPMScheduler),
        encoders=("T5EncoderModel",),
    ),
    task="text-to-video",
    tiny_builder=partial(_tiny_cogvideox, image_to_video=False),
    dit_facts=DitFacts(
        class_name=CogVideoXTransformer3DModel.diffusers_class_name,
        # The patch and text embedder, the timestep (and 1.5-I2V's ofs) embedders and the output head.
        full_precision_modules=frozenset(
            {"patch_embed", "time_embedding", "ofs_embedding", "norm_out", "proj_out"}
        ),
        # Diffusers' `CogVideoXLoraLoaderMixin` converts no other layout: Diffusers/PEFT files only.
        lora=LoraFacts(),
        # No single-file support yet: the loader refuses it naming the DiT.
    ),
    aliases=("cogvideox", "cogvideo"),
)

FAMILIES: tuple[ModelFamily, ...] = (
    _T2V,
    replace(
        _T2V,
        name="cogvideox-i2v",
        diffusers_pipeline="CogVideoXImageToVideoPipeline",
        pipeline_cls=CogVideoXImageToVideoPipeline,
        task="image-to-video",
        tiny_builder=partial(_tiny_cogvideox, image_to_video=True),
        aliases=(),
    ),
)
