"""The Qwen-Image family's records: text-to-image, Edit, Edit-Plus (several input images) and Layered (an
image decomposed into RGBA layers), which share the Qwen-Image DiT and its loader facts."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from diffserve.families.qwen_image.layered import QwenImageLayeredPipeline
from diffserve.families.qwen_image.lora_rules import QWEN_IMAGE_RULES
from diffserve.families.qwen_image.pipeline import (
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
)
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.loader.single_file_keys import identity_keys_plan
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_qwen_image import AutoencoderKLQwenImage
from diffserve.runtime.cuda_graph.padders import MaskedTextPadder

#: The tiny builder; each record names its variant of the spec.
_tiny = partial(
    lazy_tiny_builder, "diffserve.families.qwen_image.tiny", "build_tiny_qwen_image", "TinyQwenImageSpec"
)

_CLASSES = NativeClasses.of(
    models=(QwenImageTransformer2DModel, AutoencoderKLQwenImage),
    schedulers=(FlowMatchEulerScheduler,),
    encoders=("Qwen2_5_VLForConditionalGeneration",),
)
_DIT_FACTS = DitFacts(
    class_name=QwenImageTransformer2DModel.diffusers_class_name,
    full_precision_modules=frozenset({"time_text_embed", "img_in", "txt_in", "norm_out", "proj_out"}),
    lora=LoraFacts(rules=tuple(QWEN_IMAGE_RULES)),
    # Qwen-Image's original checkpoints already use Diffusers' names.
    single_file=SingleFileKeys(
        "Qwen-Image", identity_keys_plan, gguf_arches=("qwen_image",), markers=("img_mod.1.", "txt_norm.")
    ),
)

_QWEN_IMAGE = ModelFamily(
    name="qwen-image",
    diffusers_pipeline="QwenImagePipeline",
    pipeline_cls=QwenImagePipeline,
    native_classes=_CLASSES,
    task="text-to-image",
    tiny_builder=_tiny(variant="t2i"),
    dit_facts=_DIT_FACTS,
    # Text padded to the token bucket with the key mask (made at batch 1 too), RoPE and lengths following.
    prompt_padder=MaskedTextPadder(
        text="encoder_hidden_states",
        mask="encoder_hidden_states_mask",
        image_tokens_from="hidden_states",
        batch_tensors=("hidden_states", "timestep", "guidance"),
        batch_lists=("img_shapes",),
    ),
)

FAMILIES: tuple[ModelFamily, ...] = (
    _QWEN_IMAGE,
    replace(
        _QWEN_IMAGE,
        name="qwen-image-edit",
        diffusers_pipeline="QwenImageEditPipeline",
        pipeline_cls=QwenImageEditPipeline,
        task="image-edit",
        tiny_builder=_tiny(variant="edit"),
    ),
    replace(
        _QWEN_IMAGE,
        name="qwen-image-edit-plus",
        diffusers_pipeline="QwenImageEditPlusPipeline",
        pipeline_cls=QwenImageEditPlusPipeline,
        task="image-edit",
        tiny_builder=_tiny(variant="edit_plus"),
    ),
    replace(
        _QWEN_IMAGE,
        name="qwen-image-layered",
        diffusers_pipeline="QwenImageLayeredPipeline",
        pipeline_cls=QwenImageLayeredPipeline,
        task="image-edit",
        tiny_builder=_tiny(variant="layered"),
        # Eager only: its DiT calls carry the layered timestep index the padders do not pad.
        prompt_padder=None,
    ),
)
