"""Builder of small random-weight HunyuanImage 2.1 checkpoints in the Diffusers `HunyuanImagePipeline` layout
(hunyuanvideo-community/HunyuanImage-2.1-Diffusers): the same component classes and config files, shrunk.

A full `Qwen2_5_VLForConditionalGeneration` (tiny vision tower) over the in-memory byte-level Qwen tokenizer,
whose whole-word tokens cover this family's template (Qwen-Image's system prompt), so the 34 dropped
states are the template's; a ByT5-style `T5EncoderModel` with `ByT5Tokenizer`; the native DiT (every weight
noised so the text matters) and VAE, written in Diffusers' names; the flow-matching scheduler with a fixed
shift; and the guiders: `guider` (APG mixed with CFG) and, with `ocr_guider`, a second one for prompts with
quoted text. `apg_start_step` is low by default so two- and three-step tests reach the APG branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel
from diffserve.models.vaes.autoencoder_kl_hunyuan_image import AutoencoderKLHunyuanImage
from diffserve.testing.qwen_tokenizers import build_qwen_tokenizer
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    diffusers_config,
    finish_tiny_folder,
    qwen2_5_vl_encoder,
    random_native_module,
    save_diffusers_model,
    save_text_encoder,
    t5_shape,
    tiny_folder,
    write_json,
    write_random_module,
    write_scheduler_config,
)


@dataclass
class TinyHunyuanImageSpec:
    """Shape of a tiny HunyuanImage 2.1 checkpoint. `distilled` makes the guidance-distilled MeanFlow variant
    (guidance embedding, MeanFlow time, no guiders)."""

    num_layers: int = 1
    num_single_layers: int = 1
    num_refiner_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    rope_axes_dim: tuple[int, int] = (8, 8)
    latent_channels: int = 8
    #: 16x compression: few image tokens, so the text is a good part of what they attend to.
    vae_block_out_channels: tuple[int, ...] = (32, 32, 32, 32, 64)
    text_hidden_size: int = 32
    text_layers: int = 3  # the pipeline reads the states two layers below the last
    text_heads: int = 2
    text_kv_heads: int = 1
    vision_hidden_size: int = 16
    vision_depth: int = 1
    glyph_hidden_size: int = 32
    shift: float = 4.0
    guidance_scale: float = 3.5
    ocr_guider: bool = True
    ocr_guidance_scale: float = 5.0
    apg_start_step: int = 0
    distilled: bool = False
    #: N(0, this) added to every DiT weight: a random DiT is otherwise nearly blind to its text.
    dit_weight_noise: float = 1.0
    #: The output projection is scaled by this, so that noised weights still give velocities of about
    #: unit size (otherwise the latents grow to thousands and every image saturates alike).
    dit_output_scale: float = 1e-3
    seed: int = 0


def _dit_config(spec: TinyHunyuanImageSpec) -> dict:
    return {
        "in_channels": spec.latent_channels,
        "out_channels": spec.latent_channels,
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "num_layers": spec.num_layers,
        "num_single_layers": spec.num_single_layers,
        "num_refiner_layers": spec.num_refiner_layers,
        "mlp_ratio": 4.0,
        "patch_size": [1, 1],
        "qk_norm": "rms_norm",
        "guidance_embeds": spec.distilled,
        "text_embed_dim": spec.text_hidden_size,
        "text_embed_2_dim": spec.glyph_hidden_size,
        "rope_theta": 256.0,
        "rope_axes_dim": list(spec.rope_axes_dim),
        "use_meanflow": spec.distilled,
    }


def _vae_config(spec: TinyHunyuanImageSpec) -> dict:
    return {
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": spec.latent_channels,
        "block_out_channels": list(spec.vae_block_out_channels),
        "layers_per_block": 1,
        "spatial_compression_ratio": 2 ** (len(spec.vae_block_out_channels) - 1),
        "sample_size": 64,
        "scaling_factor": 0.75289,
        "downsample_match_channel": True,
        "upsample_match_channel": True,
    }


def _guider_config(spec: TinyHunyuanImageSpec, scale: float) -> dict:
    """The released guider's settings (APG scale 10, momentum -0.5, norm cap 10), with the spec's CFG scale
    and APG start step."""
    return {
        "adaptive_projected_guidance_momentum": -0.5,
        "adaptive_projected_guidance_rescale": 10.0,
        "adaptive_projected_guidance_scale": 10.0,
        "adaptive_projected_guidance_start_step": spec.apg_start_step,
        "enabled": True,
        "eta": 0.0,
        "guidance_rescale": 0.0,
        "guidance_scale": scale,
        "start": 0.0,
        "stop": 1.0,
        "use_original_formulation": False,
    }


def hunyuan_image_model_index(spec: TinyHunyuanImageSpec) -> dict:
    """The `model_index.json` of a HunyuanImage 2.1 folder (guiders null for the distilled variant)."""
    guider = None if spec.distilled else ["diffusers", "AdaptiveProjectedMixGuidance"]
    ocr_guider = guider if spec.ocr_guider else None
    return {
        "_class_name": "HunyuanImagePipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "guider": guider or [None, None],
        "ocr_guider": ocr_guider or [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "tokenizer_2": ["transformers", "ByT5Tokenizer"],
        "transformer": ["diffusers", "HunyuanImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanImage"],
    }


def build_tiny_hunyuan_image(out_dir: str | Path, spec: TinyHunyuanImageSpec | None = None) -> Path:
    """Write a random-weight HunyuanImage 2.1 folder to `out_dir` and return its path."""
    spec = spec or TinyHunyuanImageSpec()
    root = tiny_folder(out_dir, spec.seed)
    tokenizer = build_qwen_tokenizer()
    encoder = qwen2_5_vl_encoder(
        spec, tokenizer, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112
    )
    save_text_encoder(root, encoder, tokenizer)
    glyph_tokenizer = ByT5Tokenizer()
    glyph_shape = t5_shape(len(glyph_tokenizer), spec.glyph_hidden_size, 2)
    glyph_encoder = T5EncoderModel(T5Config(**glyph_shape, is_encoder_decoder=False, use_cache=False))
    save_text_encoder(root, glyph_encoder.eval(), glyph_tokenizer, "_2")

    dit_config = _dit_config(spec)
    dit = random_native_module(
        HunyuanImageTransformer2DModel, dit_config, spec.seed + 10, spec.dit_weight_noise
    )
    with torch.no_grad():
        dit.proj_out.weight.mul_(spec.dit_output_scale)
        dit.proj_out.bias.mul_(spec.dit_output_scale)
    save_diffusers_model(dit, root / "transformer", "HunyuanImageTransformer2DModel", dit_config)
    write_random_module(root / "vae", AutoencoderKLHunyuanImage, _vae_config(spec), spec.seed + 20, 0.02)
    scheduler = {"num_train_timesteps": 1000, "shift": spec.shift, "use_dynamic_shifting": False}
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", scheduler)
    if not spec.distilled:
        guiders = {"guider": spec.guidance_scale}
        if spec.ocr_guider:
            guiders["ocr_guider"] = spec.ocr_guidance_scale
        for name, scale in guiders.items():
            body = diffusers_config("AdaptiveProjectedMixGuidance", _guider_config(spec, scale))
            write_json(root / name / "guider_config.json", body)
    return finish_tiny_folder(root, hunyuan_image_model_index(spec), spec)
