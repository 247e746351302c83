"""Builder of small random-weight Mochi checkpoints in the Diffusers `MochiPipeline` layout.

A T5 encoder (`T5EncoderModel`) with an in-memory `T5Tokenizer` (256 tokens, as released), the native DiT
(`MochiTransformer3DModel`, state dict in Diffusers' names, every weight noised so the text matters, RoPE
frequencies random), the native Mochi VAE (8x spatial, 6x temporal compression, 12 latent channels with the
released per-channel mean / std, encoder weights included) and the released flow-matching scheduler config
(inverted sigmas).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import T5EncoderModel

from diffserve.models.dits.mochi import MochiTransformer3DModel
from diffserve.models.vaes.autoencoder_kl_mochi import MOCHI_VAE_CONFIG_DEFAULTS, AutoencoderKLMochi
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    finish_tiny_folder,
    save_text_encoder,
    t5_encoder_config,
    tiny_folder,
    write_random_module,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_t5_tokenizer

#: The released Mochi folder's scheduler config.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": True,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
}


@dataclass
class TinyMochiSpec:
    """Shape of a tiny Mochi checkpoint."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    pooled_projection_dim: int = 24
    time_embed_dim: int = 16
    text_dim: int = 32
    text_layers: int = 2
    #: 12, as released: Diffusers' pipeline reshapes the VAE's latents_mean / latents_std to 12 channels.
    latent_channels: int = 12
    #: model_index.json's `force_zeros_for_empty_prompt`.
    force_zeros_for_empty_prompt: bool = False
    dit_weight_noise: float = 0.2
    seed: int = 0


def _dit_config(spec: TinyMochiSpec) -> dict:
    return {
        "patch_size": 2,
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "num_layers": spec.num_layers,
        "pooled_projection_dim": spec.pooled_projection_dim,
        "in_channels": spec.latent_channels,
        "out_channels": None,
        "qk_norm": "rms_norm",
        "text_embed_dim": spec.text_dim,
        "time_embed_dim": spec.time_embed_dim,
        "activation_fn": "swiglu",
        "max_sequence_length": 256,
    }


def _vae_config(spec: TinyMochiSpec) -> dict:
    return {
        "encoder_block_out_channels": (32, 32, 32, 32),
        "decoder_block_out_channels": (32, 32, 32, 64),
        "latent_channels": spec.latent_channels,
        "layers_per_block": (1, 1, 1, 1, 1),
        "latents_mean": MOCHI_VAE_CONFIG_DEFAULTS["latents_mean"][: spec.latent_channels],
        "latents_std": MOCHI_VAE_CONFIG_DEFAULTS["latents_std"][: spec.latent_channels],
        "scaling_factor": 1.0,
    }


def mochi_model_index(spec: TinyMochiSpec) -> dict:
    """The `model_index.json` of a Mochi folder."""
    return {
        "_class_name": "MochiPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "force_zeros_for_empty_prompt": spec.force_zeros_for_empty_prompt,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "MochiTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLMochi"],
    }


def build_tiny_mochi(out_dir: str | Path, spec: TinyMochiSpec | None = None) -> Path:
    """Write a random-weight Mochi folder to `out_dir` and return its path."""
    spec = spec or TinyMochiSpec()
    root = tiny_folder(out_dir, spec.seed)
    tokenizer = build_t5_tokenizer(256)
    save_text_encoder(
        root, T5EncoderModel(t5_encoder_config(tokenizer, spec.text_dim, spec.text_layers)), tokenizer
    )
    write_random_module(
        root / "transformer",
        MochiTransformer3DModel,
        _dit_config(spec),
        spec.seed + 10,
        spec.dit_weight_noise,
    )
    write_random_module(root / "vae", AutoencoderKLMochi, _vae_config(spec), spec.seed + 20, 0.02)
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", SCHEDULER_CONFIG)
    return finish_tiny_folder(root, mochi_model_index(spec), spec)
