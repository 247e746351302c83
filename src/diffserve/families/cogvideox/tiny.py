"""Builder of small random-weight CogVideoX checkpoints in the Diffusers `CogVideoXPipeline` /
`CogVideoXImageToVideoPipeline` layouts.

A T5 encoder (`T5EncoderModel`) with an in-memory `T5Tokenizer` (226 tokens, as released), the native DiT
(`CogVideoXTransformer3DModel`, state dict in Diffusers' names, every weight noised so the text matters), the
native CogVideoX VAE (8x spatial, 4x temporal compression) and the sampler the released folders ship.
Variants (`TinyCogVideoXSpec.variant`), each laid out as the released folders of its kind:

- "1.0": CogVideoX-2B (sin-cos positions, DDIM); its image-to-video folder is CogVideoX-5B-I2V's kind
  (RoPE and learned positions, DPM), as there is no 2B image-to-video model.
- "1.0-rope": CogVideoX-5B (RoPE, DPM; I2V: RoPE and learned positions).
- "1.5": CogVideoX 1.5 (RoPE over 2-frame temporal patches, DPM, the VAE's `invert_scale_latents`; I2V adds
  the ofs embedding).

The DiT's sample size is 8 x 10 latents (64 x 80 pixels, Diffusers' default size for the folder) and 9
frames (3 latent frames); learned positions (I2V 1.0) exist for that size only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import T5EncoderModel

from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel
from diffserve.models.vaes.autoencoder_kl_cogvideox import AutoencoderKLCogVideoX
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    check_variant,
    finish_tiny_folder,
    random_native_module,
    save_diffusers_model,
    save_text_encoder,
    t5_encoder_config,
    tiny_folder,
    write_random_module,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_t5_tokenizer

VARIANTS = ("1.0", "1.0-rope", "1.5")
SCHEDULERS = {"ddim": "CogVideoXDDIMScheduler", "dpm": "CogVideoXDPMScheduler"}

#: The released CogVideoX folders' sampler config (2B: DDIM, snr_shift_scale 3; 5B and 1.5: DPM, 1).
SCHEDULER_CONFIG = {
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "clip_sample_range": 1.0,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "sample_max_value": 1.0,
    "set_alpha_to_one": True,
    "steps_offset": 0,
    "timestep_spacing": "trailing",
    "trained_betas": None,
}


@dataclass
class TinyCogVideoXSpec:
    """Shape of a tiny CogVideoX checkpoint."""

    image_to_video: bool = False
    variant: str = "1.0"
    #: "ddim" or "dpm"; None: the variant's released sampler.
    scheduler: str | None = None
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    time_embed_dim: int = 32
    text_dim: int = 32
    text_layers: int = 2
    latent_channels: int = 4
    sample_height: int = 8
    sample_width: int = 10
    sample_frames: int = 9
    dit_weight_noise: float = 0.2
    seed: int = 0


def _sampler(spec: TinyCogVideoXSpec) -> str:
    return spec.scheduler or ("ddim" if spec.variant == "1.0" and not spec.image_to_video else "dpm")


def _dit_config(spec: TinyCogVideoXSpec) -> dict:
    v15 = spec.variant == "1.5"
    rope = spec.variant != "1.0" or spec.image_to_video
    return {
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "in_channels": spec.latent_channels * (2 if spec.image_to_video else 1),
        "out_channels": spec.latent_channels,
        "time_embed_dim": spec.time_embed_dim,
        "ofs_embed_dim": spec.time_embed_dim if v15 and spec.image_to_video else None,
        "text_embed_dim": spec.text_dim,
        "num_layers": spec.num_layers,
        "sample_width": spec.sample_width,
        "sample_height": spec.sample_height,
        "sample_frames": spec.sample_frames,
        "patch_size": 2,
        "patch_size_t": 2 if v15 else None,
        "max_text_seq_length": 226,
        "use_rotary_positional_embeddings": rope,
        "use_learned_positional_embeddings": spec.image_to_video and not v15,
        "patch_bias": not v15,
    }


def _vae_config(spec: TinyCogVideoXSpec) -> dict:
    v15 = spec.variant == "1.5"
    return {
        "block_out_channels": [8, 8, 16, 16],
        "latent_channels": spec.latent_channels,
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "sample_height": spec.sample_height * 8,
        "sample_width": spec.sample_width * 8,
        "scaling_factor": 0.7 if v15 else 1.15258426,
        "invert_scale_latents": v15,
    }


def cogvideox_model_index(spec: TinyCogVideoXSpec) -> dict:
    """The `model_index.json` of a CogVideoX folder."""
    return {
        "_class_name": "CogVideoXImageToVideoPipeline" if spec.image_to_video else "CogVideoXPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", SCHEDULERS[_sampler(spec)]],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "CogVideoXTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLCogVideoX"],
    }


def build_tiny_cogvideox(out_dir: str | Path, spec: TinyCogVideoXSpec | None = None) -> Path:
    """Write a random-weight CogVideoX folder to `out_dir` and return its path."""
    spec = spec or TinyCogVideoXSpec()
    check_variant("CogVideoX", spec.variant, VARIANTS)
    check_variant("CogVideoX scheduler", _sampler(spec), SCHEDULERS)
    root = tiny_folder(out_dir, spec.seed)
    tokenizer = build_t5_tokenizer(226)
    save_text_encoder(
        root, T5EncoderModel(t5_encoder_config(tokenizer, spec.text_dim, spec.text_layers)), tokenizer
    )
    dit_config = _dit_config(spec)
    dit = random_native_module(CogVideoXTransformer3DModel, dit_config, spec.seed + 10, spec.dit_weight_noise)
    if dit_config["use_learned_positional_embeddings"]:  # a learned table, not the zeros it starts as
        generator = torch.Generator().manual_seed(spec.seed + 11)
        table = dit.patch_embed.pos_embedding
        table.copy_(torch.randn(table.shape, generator=generator) * 0.5)
    save_diffusers_model(dit, root / "transformer", "CogVideoXTransformer3DModel", dit_config)
    write_random_module(root / "vae", AutoencoderKLCogVideoX, _vae_config(spec), spec.seed + 20, 0.02)
    snr_shift = 3.0 if _sampler(spec) == "ddim" else 1.0
    write_scheduler_config(
        root, SCHEDULERS[_sampler(spec)], {**SCHEDULER_CONFIG, "snr_shift_scale": snr_shift}
    )
    return finish_tiny_folder(root, cogvideox_model_index(spec), spec)
