"""Builder of small random-weight LongCat-Image checkpoints in the Diffusers `LongCatImagePipeline` and
`LongCatImageEditPipeline` layouts (the same components; `TinyLongCatImageSpec.variant` picks).

The folder has the released model's components: a Qwen2.5-VL text encoder (a full
`Qwen2_5_VLForConditionalGeneration` with a tiny vision tower; the DiT's `joint_attention_dim` is its
hidden size), the byte-level Qwen tokenizer, the `text_processor/` (the text-to-image pipeline's prompt
rewriting reads it, the edit pipeline its image processor), FLUX.1's kind of 16-channel `AutoencoderKL` and a FLUX-style scheduler. It loads unchanged in
diffserve and in Diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.testing.qwen_processors import write_qwen_vl_processor
from diffserve.testing.qwen_tokenizers import build_qwen_tokenizer
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    RESOLUTION_SHIFT_SCHEDULER_CONFIG,
    check_variant,
    double_single_stream_dit_config,
    finish_tiny_folder,
    qwen2_5_vl_encoder,
    save_text_encoder,
    tiny_folder,
    write_autoencoder_kl,
    write_random_module,
    write_scheduler_config,
)

#: The released LongCat-Image scheduler_config.json values: FLUX.1's.
LONGCAT_IMAGE_SCHEDULER_CONFIG = RESOLUTION_SHIFT_SCHEDULER_CONFIG


@dataclass
class TinyLongCatImageSpec:
    """Shape of a tiny LongCat-Image checkpoint (a DiT of about 0.1M parameters)."""

    num_layers: int = 1
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    latent_channels: int = 16
    vae_block_out_channels: tuple[int, ...] = (16, 32, 32, 32)
    vae_norm_num_groups: int = 8
    text_hidden_size: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    vision_hidden_size: int = 16
    vision_depth: int = 1
    #: The most pixels the vision tower sees of an edit's input image (the real processor allows 12.8M).
    image_max_pixels: int = 28 * 28 * 16
    #: "t2i" (LongCatImagePipeline) or "edit" (LongCatImageEditPipeline).
    variant: str = "t2i"
    seed: int = 0


PIPELINE_CLASSES = {"t2i": "LongCatImagePipeline", "edit": "LongCatImageEditPipeline"}


def longcat_image_model_index(variant: str = "t2i") -> dict:
    """The `model_index.json` of a LongCatImagePipeline ("t2i") or LongCatImageEditPipeline ("edit") folder:
    the same components."""
    return {
        "_class_name": PIPELINE_CLASSES[variant],
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "text_processor": ["transformers", "Qwen2VLProcessor"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "LongCatImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def build_tiny_longcat_image(out_dir: str | Path, spec: TinyLongCatImageSpec | None = None) -> Path:
    """Write a random-weight LongCat-Image folder to `out_dir` and return its path."""
    spec = spec or TinyLongCatImageSpec()
    check_variant("LongCat-Image", spec.variant, PIPELINE_CLASSES)
    root = tiny_folder(out_dir, spec.seed)

    tokenizer = build_qwen_tokenizer()
    save_text_encoder(root, qwen2_5_vl_encoder(spec, tokenizer), tokenizer)
    write_qwen_vl_processor(root / "text_processor", tokenizer, max_pixels=spec.image_max_pixels)

    dit_config = {
        **double_single_stream_dit_config(spec, spec.text_hidden_size, out_channels=False),
        "pooled_projection_dim": spec.text_hidden_size,
        "axes_dims_rope": list(spec.axes_dims_rope),
    }
    write_random_module(root / "transformer", LongCatImageTransformer2DModel, dit_config, spec.seed + 10, 0.1)
    write_autoencoder_kl(root / "vae", spec)
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", LONGCAT_IMAGE_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, longcat_image_model_index(spec.variant), spec)
