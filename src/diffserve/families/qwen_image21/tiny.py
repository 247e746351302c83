"""Builder of small random-weight Qwen-Image 2.1 checkpoints in the Diffusers `QwenImage21Pipeline` layout.

A tiny `Qwen3VLForConditionalGeneration` (text stack with interleaved multimodal RoPE sections, a one-block
vision tower) and its `Qwen3VLProcessor` folder (the byte-level Qwen tokenizer with whole-word template
merges and a chat template, a PIL image-processor config; written directly, as transformers builds a
Qwen3-VL processor only with torchvision), the native DiT and VAE (Diffusers' names, random weights; the
DiT's noised so the prompt matters), a resolution-shifted flow-matching scheduler and, optionally, the
folder's `sample_sigmas`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from diffserve.families.qwen_image21.config import SAMPLE_SIGMAS_KEY
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.models.vaes.autoencoder_kl_qwen_image21 import (
    LATENTS_MEAN,
    LATENTS_STD,
    AutoencoderKLQwenImage21,
)
from diffserve.testing.qwen_tokenizers import QWEN_CHAT_TEMPLATE, build_qwen_tokenizer
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    RESOLUTION_SHIFT_SCHEDULER_CONFIG,
    finish_tiny_folder,
    qwen_text_shape,
    qwen_vl_token_ids,
    tiny_folder,
    write_random_module,
    write_scheduler_config,
)

#: Resolution-shifted flow matching (shift 1: the dynamic `mu` only), as Diffusers' pipeline computes `mu`.
SCHEDULER_CONFIG = {**RESOLUTION_SHIFT_SCHEDULER_CONFIG, "shift": 1.0}


@dataclass
class TinyQwenImage21Spec:
    """Shape of a tiny Qwen-Image 2.1 checkpoint."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    latent_channels: int = 16
    text_hidden_size: int = 32
    text_layers: int = 2
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 1, 2, 2, 2)
    #: model_index.json's `sample_sigmas` (None: Diffusers' linspace of `num_inference_steps`).
    sample_sigmas: tuple[float, ...] | None = None
    dit_weight_noise: float = 0.2
    seed: int = 0


def qwen3_vl_encoder(spec: TinyQwenImage21Spec, tokenizer) -> Qwen3VLForConditionalGeneration:
    """A tiny Qwen3-VL (eval mode) over the byte-level Qwen tokenizer."""
    text = qwen_text_shape(tokenizer, spec.text_hidden_size, spec.text_layers, 2, 1, 32768)
    head_dim = spec.text_hidden_size // 2
    half = head_dim // 2
    text["head_dim"] = head_dim
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
        "mrope_interleaved": True,
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": spec.text_hidden_size,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        **qwen_vl_token_ids(tokenizer),
        tie_word_embeddings=False,
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def write_qwen3_vl_processor(directory: Path, tokenizer, max_pixels: int = 64 * 64 * 4) -> None:
    """A `Qwen3VLProcessor` folder: tokenizer files, chat template and the image processor's config."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(tokenizer.chat_template)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=32 * 32,
        max_pixels=max_pixels,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    image_processor.save_pretrained(directory)
    config_path = directory / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config["processor_class"] = "Qwen3VLProcessor"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def qwen_image21_model_index(spec: TinyQwenImage21Spec) -> dict:
    """The `model_index.json` of a Qwen-Image 2.1 folder."""
    return {
        "_class_name": "QwenImage21Pipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "processor": ["transformers", "Qwen3VLProcessor"],
        SAMPLE_SIGMAS_KEY: None if spec.sample_sigmas is None else list(spec.sample_sigmas),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage21"],
    }


def build_tiny_qwen_image21(out_dir: str | Path, spec: TinyQwenImage21Spec | None = None) -> Path:
    """Write a random-weight Qwen-Image 2.1 folder to `out_dir` and return its path."""
    spec = spec or TinyQwenImage21Spec()
    root = tiny_folder(out_dir, spec.seed)
    tokenizer = build_qwen_tokenizer(chat_template=QWEN_CHAT_TEMPLATE)
    qwen3_vl_encoder(spec, tokenizer).save_pretrained(root / "text_encoder")
    write_qwen3_vl_processor(root / "processor", tokenizer)
    c = spec.latent_channels
    dit_config = {
        "patch_size": 1,
        "in_channels": c,
        "out_channels": c,
        "num_layers": spec.num_layers,
        "attention_head_dim": spec.attention_head_dim,
        "num_attention_heads": spec.num_attention_heads,
        "context_in_dim": spec.text_hidden_size,
        "mlp_ratio": 3,
        "axes_dims_rope": list(spec.axes_dims_rope),
        "eps": 1e-6,
        "causal_condition": True,
    }
    write_random_module(
        root / "transformer", QwenImage21Transformer2DModel, dit_config, spec.seed + 10, spec.dit_weight_noise
    )
    levels = len(spec.vae_dim_mult)
    vae_config = {
        "base_dim": spec.vae_base_dim,
        "decoder_base_dim": spec.vae_base_dim + 4,
        "z_dim": c,
        "dim_mult": list(spec.vae_dim_mult),
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False] + [True] * (levels - 2),
        "dropout": 0.0,
        "latents_mean": list(LATENTS_MEAN[:c]),
        "latents_std": list(LATENTS_STD[:c]),
        "is_residual": True,
        "in_channels": 4,
        "out_channels": 4,
    }
    write_random_module(root / "vae", AutoencoderKLQwenImage21, vae_config, spec.seed + 20)
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", SCHEDULER_CONFIG)
    return finish_tiny_folder(root, qwen_image21_model_index(spec), spec)
