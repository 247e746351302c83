"""Builder of small random-weight Chroma checkpoints in the Diffusers `ChromaPipeline` layout.

Used by the tests and `diffserve make-tiny chroma`. The DiT and VAE are diffserve's native modules (their
state dicts use Diffusers' names), the text encoder a transformers T5; the folder loads unchanged in both
diffserve and diffusers' `ChromaPipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import T5EncoderModel

from diffserve.models.dits.chroma import ChromaTransformer2DModel
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    RESOLUTION_SHIFT_SCHEDULER_CONFIG,
    double_single_stream_dit_config,
    finish_tiny_folder,
    save_diffusers_model,
    save_text_encoder,
    t5_encoder_config,
    tiny_folder,
    write_autoencoder_kl,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_t5_tokenizer

#: The released Chroma1-HD scheduler_config.json values: FLUX.1's (resolution-dependent shift).
CHROMA_SCHEDULER_CONFIG = RESOLUTION_SHIFT_SCHEDULER_CONFIG


@dataclass
class TinyChromaSpec:
    """Shape of a tiny Chroma checkpoint: a DiT of ~0.1M parameters that runs in milliseconds."""

    num_layers: int = 1
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    approximator_num_channels: int = 16
    approximator_hidden_dim: int = 32
    approximator_layers: int = 2
    latent_channels: int = 16
    vae_block_out_channels: tuple[int, ...] = (16, 32, 32, 32)
    vae_norm_num_groups: int = 8
    text_hidden_size: int = 32
    text_layers: int = 2
    t5_max_length: int = 512
    seed: int = 0


def chroma_model_index() -> dict:
    """The `model_index.json` of a ChromaPipeline folder (no IP-Adapter image encoder, as released)."""
    return {
        "_class_name": "ChromaPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "ChromaTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def build_tiny_chroma(out_dir: str | Path, spec: TinyChromaSpec | None = None) -> Path:
    """Write a random-weight Chroma folder to `out_dir` and return its path."""
    spec = spec or TinyChromaSpec()
    root = tiny_folder(out_dir, spec.seed)

    tokenizer = build_t5_tokenizer(spec.t5_max_length)
    t5 = T5EncoderModel(t5_encoder_config(tokenizer, spec.text_hidden_size, spec.text_layers))
    save_text_encoder(root, t5, tokenizer)

    dit_config = {
        **double_single_stream_dit_config(spec, spec.text_hidden_size),
        "axes_dims_rope": list(spec.axes_dims_rope),
        "approximator_num_channels": spec.approximator_num_channels,
        "approximator_hidden_dim": spec.approximator_hidden_dim,
        "approximator_layers": spec.approximator_layers,
    }
    dit = ChromaTransformer2DModel.from_config(dit_config)
    save_diffusers_model(dit, root / "transformer", "ChromaTransformer2DModel", dit_config)

    write_autoencoder_kl(root / "vae", spec)
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", CHROMA_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, chroma_model_index(), spec)
