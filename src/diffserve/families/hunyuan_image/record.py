"""The HunyuanImage 2.1 family's record: text-to-image (`HunyuanImagePipeline`): Qwen2.5-VL and ByT5 (glyph)
text, a double- and single-stream DiT on a 32x VAE's latents, flow-matching Euler steps, and the folder's
adaptive-projected guidance (its `guider` / `ocr_guider` components)."""

from __future__ import annotations

from pathlib import Path

from diffserve.families.hunyuan_image.guider import AdaptiveProjectedMixGuidance
from diffserve.families.hunyuan_image.pipeline import HunyuanImagePipeline
from diffserve.families.hunyuan_image.single_file_keys import hunyuan_image_plan
from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.loader.dit_facts import DitFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_hunyuan_image import AutoencoderKLHunyuanImage


def _tiny_hunyuan_image(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    """Imports its module when called (transformers model classes the registry does not need)."""
    from diffserve.families.hunyuan_image.tiny import TinyHunyuanImageSpec, build_tiny_hunyuan_image

    return build_tiny_hunyuan_image(out_dir, TinyHunyuanImageSpec(seed=options.seed))


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="hunyuan-image-2.1",
        diffusers_pipeline="HunyuanImagePipeline",
        pipeline_cls=HunyuanImagePipeline,
        native_classes=NativeClasses.of(
            models=(HunyuanImageTransformer2DModel, AutoencoderKLHunyuanImage),
            schedulers=(FlowMatchEulerScheduler,),
            guiders=(AdaptiveProjectedMixGuidance,),
            encoders=("Qwen2_5_VLForConditionalGeneration", "T5EncoderModel"),
        ),
        task="text-to-image",
        tiny_builder=_tiny_hunyuan_image,
        dit_facts=DitFacts(
            class_name=HunyuanImageTransformer2DModel.diffusers_class_name,
            # `--quantization`: the patch embedder, both text inputs (the Qwen token refiner and the
            # ByT5 projection), the timestep / guidance embedder and the output head stay in full precision.
            full_precision_modules=frozenset(
                {
                    "x_embedder",
                    "context_embedder",
                    "context_embedder_2",
                    "time_guidance_embed",
                    "norm_out",
                    "proj_out",
                }
            ),
            # No LoRA: Diffusers' `HunyuanImagePipeline` has no LoRA loader (no `load_lora_weights`).
            # Single files: Tencent's originals (`dit/hunyuanimage2.1*.safetensors`, which ComfyUI loads
            # and Comfy-Org repackages) in their names, split or fused projections
            # (`single_file_keys.py`), or Diffusers' names. GGUFs made with city96's tool say "hyvid".
            single_file=SingleFileKeys(
                "HunyuanImage 2.1",
                hunyuan_image_plan,
                gguf_arches=("hyvid",),
                markers=(
                    "byt5_in.",
                    "txt_in.individual_token_refiner.",
                    "img_attn_q_norm.",
                    "context_embedder_2.",
                    "time_guidance_embed.",
                ),
            ),
        ),
        aliases=("hunyuanimage", "hunyuan-image", "hunyuanimage-2.1", "hunyuan_image"),
    ),
)
