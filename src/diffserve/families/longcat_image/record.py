"""The LongCat-Image family's records: text-to-image (`LongCatImagePipeline`) and edit
(`LongCatImageEditPipeline`), which share the DiT and its loader facts; the DiT is FLUX.1's blocks with
its own timestep embedding, its text encoder Qwen2.5-VL, its VAE FLUX.1's kind of `AutoencoderKL`."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from diffserve.families.longcat_image.pipeline import LongCatImageEditPipeline, LongCatImagePipeline
from diffserve.families.longcat_image.single_file_keys import longcat_image_plan
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.runtime.cuda_graph.padders import FixedLengthPadder

#: The tiny builder; each record names its variant of the spec.
_tiny = partial(
    lazy_tiny_builder,
    "diffserve.families.longcat_image.tiny",
    "build_tiny_longcat_image",
    "TinyLongCatImageSpec",
)

_LONGCAT_IMAGE = ModelFamily(
    name="longcat-image",
    diffusers_pipeline="LongCatImagePipeline",
    pipeline_cls=LongCatImagePipeline,
    native_classes=NativeClasses.of(
        models=(LongCatImageTransformer2DModel, AutoencoderKL),
        schedulers=(FlowMatchEulerScheduler,),
        encoders=("Qwen2_5_VLForConditionalGeneration",),
    ),
    task="text-to-image",
    tiny_builder=_tiny(variant="t2i"),
    # Every prompt is padded to 512 tokens: only the batch is padded.
    prompt_padder=FixedLengthPadder(
        rows_from="hidden_states",
        batch_tensors=("hidden_states", "encoder_hidden_states", "context", "timestep"),
    ),
    dit_facts=DitFacts(
        class_name=LongCatImageTransformer2DModel.diffusers_class_name,
        full_precision_modules=frozenset(
            {"time_embed", "context_embedder", "x_embedder", "norm_out", "proj_out"}
        ),
        # Single files: Meituan's release is in Diffusers' names; ComfyUI's (Comfy-Org's repackaged files)
        # and the community GGUFs (stduhpf's, for stable-diffusion.cpp) use FLUX.1's BFL names
        # (`single_file_keys.py`). No city96 GGUF of it was found, so no architecture string is stated. The
        # markers are the timestep MLP's Diffusers names, which FLUX.1's files do not have (its BFL names
        # have no marker of their own).
        single_file=SingleFileKeys(
            "LongCat-Image",
            longcat_image_plan,
            markers=("time_embed.timestep_embedder.linear_1.", "time_embed.timestep_embedder.linear_2."),
        ),
    ),
    aliases=("longcat", "longcat_image"),
)

FAMILIES: tuple[ModelFamily, ...] = (
    _LONGCAT_IMAGE,
    replace(
        _LONGCAT_IMAGE,
        name="longcat-image-edit",
        diffusers_pipeline="LongCatImageEditPipeline",
        pipeline_cls=LongCatImageEditPipeline,
        task="image-edit",
        tiny_builder=_tiny(variant="edit"),
        aliases=("longcat-edit", "longcat_image_edit"),
    ),
)
