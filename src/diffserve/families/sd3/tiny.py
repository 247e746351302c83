"""Builder of small random-weight Stable Diffusion 3 checkpoints in the Diffusers layout.

Two CLIP encoders with projection (CLIP-L and CLIP-G stand-ins), T5, the native SD3 transformer and
a 16-channel KL autoencoder; the folder loads in diffserve and in diffusers' StableDiffusion3Pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.testing.tiny_writing import DIFFUSERS_FORMAT_VERSION, diffusers_config, save_diffusers_model
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


def _clip(tokenizer, hidden: int) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=hidden,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def build_tiny_sd3(out_dir: str | Path, spec: TinySD3Spec | None = None) -> Path:
    """Write a random-weight SD3 folder to `out_dir` and return its path."""
    spec = spec or TinySD3Spec()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    clip_tok = build_clip_tokenizer()
    t5_tok = build_t5_tokenizer()
    for i, name in enumerate(("text_encoder", "text_encoder_2")):
        _clip(clip_tok, spec.clip_hidden_size + 8 * i).save_pretrained(root / name)
        clip_tok.save_pretrained(root / ("tokenizer" if i == 0 else "tokenizer_2"))
    T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=spec.t5_hidden_size,
            d_kv=8,
            d_ff=spec.t5_hidden_size * 2,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            dense_act_fn="gelu_new",
            is_gated_act=True,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
        )
    ).save_pretrained(root / "text_encoder_3")
    t5_tok.save_pretrained(root / "tokenizer_3")

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
    n = len(spec.vae_block_out_channels)
    vae_config = {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "block_out_channels": list(spec.vae_block_out_channels),
        "layers_per_block": 1,
        "act_fn": "silu",
        "latent_channels": 16,
        "norm_num_groups": spec.vae_norm_num_groups,
        "sample_size": 64,
        "scaling_factor": 1.5305,
        "shift_factor": 0.0609,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }
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
    (root / "model_index.json").write_text(json.dumps(model_index, indent=2))
    return root
