"""Builder of small random-weight Stable Diffusion 3 checkpoints in the Diffusers layout.

Two CLIP encoders with projection (CLIP-L and CLIP-G stand-ins), T5, the native SD3 transformer and
a 16-channel KL autoencoder; the folder loads in diffserve and in diffusers' StableDiffusion3Pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import CLIPTextModelWithProjection, T5EncoderModel

from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    autoencoder_kl_config,
    clip_text_config,
    diffusers_config,
    save_diffusers_model,
    save_text_encoder,
    t5_encoder_config,
    tiny_folder,
    write_json,
)
from diffserve.testing.tokenizers import build_clip_tokenizer, build_t5_tokenizer


@dataclass
class TinySD3Spec:
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    qk_norm: str | None = None
    dual_attention_layers: tuple[int, ...] = ()
    clip_hidden_size: int = 16  # CLIP-L; CLIP-G gets 8 more. Their concatenation must fit in T5 width
    t5_hidden_size: int = 48
    sample_size: int = 8
    pos_embed_max_size: int = 16
    vae_block_out_channels: tuple[int, ...] = (16, 32, 32, 32)
    seed: int = 0
    vae_norm_num_groups: int = 8  # must divide every VAE block width


def build_tiny_sd3(out_dir: str | Path, spec: TinySD3Spec | None = None) -> Path:
    """Write a random-weight SD3 folder to `out_dir` and return its path."""
    spec = spec or TinySD3Spec()
    root = tiny_folder(out_dir, spec.seed)
    clip_tok = build_clip_tokenizer()
    t5_tok = build_t5_tokenizer()
    for i, suffix in enumerate(("", "_2")):  # CLIP-L, then CLIP-G 8 wider
        clip = CLIPTextModelWithProjection(clip_text_config(clip_tok, spec.clip_hidden_size + 8 * i))
        save_text_encoder(root, clip, clip_tok, suffix)
    save_text_encoder(root, T5EncoderModel(t5_encoder_config(t5_tok, spec.t5_hidden_size)), t5_tok, "_3")

    dit_config = {
        "sample_size": spec.sample_size,
        "patch_size": 2,
        "in_channels": 16,
        "num_layers": spec.num_layers,
        "attention_head_dim": spec.attention_head_dim,
        "num_attention_heads": spec.num_attention_heads,
        "joint_attention_dim": spec.t5_hidden_size,
        "caption_projection_dim": spec.attention_head_dim * spec.num_attention_heads,
        "pooled_projection_dim": 2 * spec.clip_hidden_size + 8,
        "out_channels": 16,
        "pos_embed_max_size": spec.pos_embed_max_size,
        "dual_attention_layers": list(spec.dual_attention_layers),
        "qk_norm": spec.qk_norm,
    }
    save_diffusers_model(
        SD3Transformer2DModel.from_config(dit_config),
        root / "transformer",
        "SD3Transformer2DModel",
        dit_config,
    )
    vae_config = autoencoder_kl_config(
        spec.vae_block_out_channels, 16, spec.vae_norm_num_groups, scaling_factor=1.5305, shift_factor=0.0609
    )
    save_diffusers_model(AutoencoderKL.from_config(vae_config), root / "vae", "AutoencoderKL", vae_config)
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(
            diffusers_config("FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": 1000, "shift": 3.0})
        )
    )
    model_index = {
        "_class_name": "StableDiffusion3Pipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "image_encoder": [None, None],
        "feature_extractor": [None, None],
    }
    write_json(root / "model_index.json", model_index)
    return root
