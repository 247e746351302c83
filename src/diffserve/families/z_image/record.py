"""The Z-Image family's record (`ZImagePipeline`)."""

from __future__ import annotations

from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.families.z_image.lora_rules import Z_IMAGE_RULES
from diffserve.families.z_image.pipeline import ZImagePipeline
from diffserve.families.z_image.single_file_keys import UNUSED, z_image_plan
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.runtime.cuda_graph.padders import NativeLengthPadder

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="z-image",
        diffusers_pipeline="ZImagePipeline",
        pipeline_cls=ZImagePipeline,
        native_classes=NativeClasses.of(
            models=(ZImageTransformer2DModel, AutoencoderKL),
            schedulers=(FlowMatchEulerScheduler,),
            encoders=("Qwen3Model",),
        ),
        task="text-to-image",
        tiny_builder=lazy_tiny_builder(
            "diffserve.families.z_image.tiny", "build_tiny_zimage", "TinyZImageSpec"
        ),
        # Extra caption tokens would be attended: prompts keep their length (the DiT rounds it to 32).
        prompt_padder=NativeLengthPadder(
            rows_from="x",
            batch_tensors=("t",),
            batch_lists=("x", "cap_feats", "refined_captions"),
            caption_lists=("cap_feats", "refined_captions"),
            multiple=32,  # the DiT's SEQ_MULTI_OF
        ),
        dit_facts=DitFacts(
            class_name=ZImageTransformer2DModel.diffusers_class_name,
            full_precision_modules=frozenset(
                {"all_x_embedder", "t_embedder", "cap_embedder", "all_final_layer"}
            ),
            lora=LoraFacts(rules=tuple(Z_IMAGE_RULES)),
            single_file=SingleFileKeys(
                "Z-Image", z_image_plan, UNUSED, ("lumina2",), markers=("noise_refiner.", "cap_embedder.")
            ),
        ),
        aliases=("zimage", "z_image"),
    ),
)
