"""The HunyuanVideo (1.0) family's records: text-to-video (`HunyuanVideoPipeline`): Llama and CLIP text, the
double/single-stream DiT with embedded guidance on HunyuanVideo's causal VAE latents, flow-matching Euler
steps over shifted linear sigmas, optional true CFG; and image-to-video (`HunyuanVideoImageToVideoPipeline`):
Llava reads the prompt with the input image, whose VAE latents condition the DiT ("token_replace" or
"latent_concat"). Both records share the DiT class and its facts."""

from __future__ import annotations

from pathlib import Path

from diffserve.families.hunyuan_video.image_to_video_pipeline import HunyuanVideoImageToVideoPipeline
from diffserve.families.hunyuan_video.lora_rules import refuse_original_names
from diffserve.families.hunyuan_video.pipeline import HunyuanVideoPipeline
from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.loader.dit_facts import DitFacts, LoraFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_hunyuan_video import AutoencoderKLHunyuanVideo


def _tiny_hunyuan_video(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    """Imports its module when called (transformers model classes the registry does not need)."""
    from diffserve.families.hunyuan_video.tiny import TinyHunyuanVideoSpec, build_tiny_hunyuan_video

    return build_tiny_hunyuan_video(out_dir, TinyHunyuanVideoSpec(seed=options.seed))


def _tiny_hunyuan_video_i2v(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    """Imports its module when called (transformers model classes the registry does not need)."""
    from diffserve.families.hunyuan_video.image_to_video_tiny import (
        TinyHunyuanVideoI2VSpec,
        build_tiny_hunyuan_video_i2v,
    )

    return build_tiny_hunyuan_video_i2v(out_dir, TinyHunyuanVideoI2VSpec(seed=options.seed))


#: `--quantization` keeps the patch, timestep / guidance / pooled-text embedders, the token refiner
#: (`context_embedder`: the text projection and its refiner blocks) and the output head in full precision.
#: LoRA: Diffusers/PEFT-format files (`HunyuanVideoLoraLoaderMixin` loads the transformer only); files in
#: the original checkpoint's names are refused with that reason (lora_rules.py).
#: No single-file support yet: the loader refuses it naming the DiT.
_DIT_FACTS = DitFacts(
    class_name=HunyuanVideoTransformer3DModel.diffusers_class_name,
    full_precision_modules=frozenset(
        {"x_embedder", "context_embedder", "time_text_embed", "norm_out", "proj_out"}
    ),
    lora=LoraFacts(components=("transformer",), community=refuse_original_names),
)

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="hunyuan-video",
        diffusers_pipeline="HunyuanVideoPipeline",
        pipeline_cls=HunyuanVideoPipeline,
        native_classes=NativeClasses.of(
            models=(HunyuanVideoTransformer3DModel, AutoencoderKLHunyuanVideo),
            schedulers=(FlowMatchEulerScheduler,),
            encoders=("LlamaModel", "CLIPTextModel"),
        ),
        task="text-to-video",
        tiny_builder=_tiny_hunyuan_video,
        dit_facts=_DIT_FACTS,
        aliases=("hunyuanvideo", "hunyuan_video", "hunyuan-video-t2v"),
    ),
    ModelFamily(
        name="hunyuan-video-i2v",
        diffusers_pipeline="HunyuanVideoImageToVideoPipeline",
        pipeline_cls=HunyuanVideoImageToVideoPipeline,
        native_classes=NativeClasses.of(
            models=(HunyuanVideoTransformer3DModel, AutoencoderKLHunyuanVideo),
            schedulers=(FlowMatchEulerScheduler,),
            encoders=("LlavaForConditionalGeneration", "CLIPTextModel"),
        ),
        task="image-to-video",
        tiny_builder=_tiny_hunyuan_video_i2v,
        dit_facts=_DIT_FACTS,
        aliases=("hunyuanvideo-i2v", "hunyuan_video_i2v"),
    ),
)
