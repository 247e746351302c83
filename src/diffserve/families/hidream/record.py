"""The HiDream-I1 family's record: text-to-image (`HiDreamImagePipeline`: HiDream-I1 Full, Dev and Fast): two
CLIP encoders, T5 and Llama 3.1 text, the sparse (mixture-of-experts) double/single-stream DiT, FLUX.1's VAE,
flow-matching Euler or UniPC steps."""

from __future__ import annotations

from diffserve.families.hidream.pipeline import HiDreamPipeline
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.loader.single_file_keys import identity_keys_plan
from diffserve.models.dits.hidream_image import HiDreamImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="hidream-i1",
        diffusers_pipeline="HiDreamImagePipeline",
        pipeline_cls=HiDreamPipeline,
        native_classes=NativeClasses.of(
            models=(HiDreamImageTransformer2DModel, AutoencoderKL),
            schedulers=(FlowMatchEulerScheduler, UniPCFlowScheduler),
            encoders=("CLIPTextModelWithProjection", "T5EncoderModel", "LlamaForCausalLM"),
        ),
        task="text-to-image",
        tiny_builder=lazy_tiny_builder(
            "diffserve.families.hidream.tiny", "build_tiny_hidream", "TinyHiDreamSpec"
        ),
        dit_facts=DitFacts(
            class_name=HiDreamImageTransformer2DModel.diffusers_class_name,
            # `--quantization`: the patch, timestep and pooled-text embedders, the caption projections
            # and the output head (`final_layer`) stay in full precision; every Linear of the blocks,
            # each routed and shared expert's included, is quantized (the MoE gate is no Linear).
            full_precision_modules=frozenset(
                {"x_embedder", "t_embedder", "p_embedder", "caption_projection", "final_layer"}
            ),
            # LoRA: Diffusers/PEFT-format files, and `diffusion_model.` ones, whose module names are
            # Diffusers' own (`_convert_non_diffusers_hidream_lora_to_diffusers` only strips the prefix);
            # adapters on the routed MoE experts apply to their own requests' routed tokens (MoEFeedForward).
            lora=LoraFacts(components=("transformer",), rules=()),
            # Single files (ComfyUI's, under `model.diffusion_model.`) use Diffusers' names: Diffusers'
            # `convert_hidream_transformer_to_diffusers` only strips the prefix. city96's GGUF files say
            # "hidream".
            single_file=SingleFileKeys(
                "HiDream-I1",
                identity_keys_plan,
                gguf_arches=("hidream",),
                markers=("double_stream_blocks.", "ff_i.gate."),
            ),
        ),
        aliases=("hidream", "hidream-i1-full", "hidream-i1-dev", "hidream-i1-fast"),
    ),
)
