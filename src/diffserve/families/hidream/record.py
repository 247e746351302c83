"""The HiDream-I1 family's record: text-to-image (`HiDreamImagePipeline`: HiDream-I1 Full, Dev and Fast): two
CLIP encoders, T5 and Llama 3.1 text, the sparse (mixture-of-experts) double/single-stream DiT, FLUX.1's VAE,
flow-matching Euler or UniPC steps."""

from __future__ import annotations

from diffserve.families.hidream.pipeline import HiDreamPipeline
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
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
        # No quantization, LoRA or single-file support yet: the loader refuses them naming the DiT.
        dit_facts=DitFacts(class_name=HiDreamImageTransformer2DModel.diffusers_class_name),
        aliases=("hidream", "hidream-i1-full", "hidream-i1-dev", "hidream-i1-fast"),
    ),
)
