"""The Qwen-Image 2.1 family's record: text to image, and image-conditioned with input images
(`QwenImage21Pipeline`): Qwen3-VL prompt states (condition images in their vision slots), a block-causal
single-stream DiT on the latents of its 16x RGBA VAE (condition images' latents in its prefix),
flow-matching Euler steps."""

from __future__ import annotations

from diffserve.families.qwen_image21.lora_rules import QWEN_IMAGE21_RULES
from diffserve.families.qwen_image21.pipeline import QwenImage21Pipeline
from diffserve.families.qwen_image21.single_file_keys import qwen_image21_plan
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_qwen_image21 import AutoencoderKLQwenImage21

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="qwen-image-2.1",
        diffusers_pipeline="QwenImage21Pipeline",
        pipeline_cls=QwenImage21Pipeline,
        native_classes=NativeClasses.of(
            models=(QwenImage21Transformer2DModel, AutoencoderKLQwenImage21),
            schedulers=(FlowMatchEulerScheduler,),
            encoders=("Qwen3VLForConditionalGeneration",),
        ),
        task="text-to-image",
        tiny_builder=lazy_tiny_builder(
            "diffserve.families.qwen_image21.tiny", "build_tiny_qwen_image21", "TinyQwenImage21Spec"
        ),
        dit_facts=DitFacts(
            class_name=QwenImage21Transformer2DModel.diffusers_class_name,
            # The embedders, the modulation shared by every block (its timestep projection) and the head.
            full_precision_modules=frozenset(
                {"time_text_embed", "txt_in", "img_in", "modulation", "norm_out", "proj_out"}
            ),
            # Diffusers' `QwenImage21Pipeline` loads LoRAs with Qwen-Image's `QwenImageLoraLoaderMixin`.
            lora=LoraFacts(rules=tuple(QWEN_IMAGE21_RULES)),
            # ComfyUI's files: Diffusers' names with each block's SwiGLU gate and up fused (single_file_keys.py).
            single_file=SingleFileKeys(
                "Qwen-Image 2.1", qwen_image21_plan, markers=("img_mlp.gate_up.", "img_mlp.gate_layer.")
            ),
        ),
        aliases=("qwenimage21", "qwen_image21", "qwen-image21", "qwen-image-21"),
    ),
)
