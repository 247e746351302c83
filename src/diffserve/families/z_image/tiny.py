"""Builder of small random-weight Z-Image checkpoints in the Diffusers `ZImagePipeline` layout.

Z-Image pairs a Qwen3 text encoder (its second-to-last hidden state, one unpadded sequence per prompt)
with a single-stream DiT (`ZImageTransformer2DModel`: caption and noise refiner blocks, then joint
blocks over the concatenated sequence padded to multiples of 32) and the 16-channel FLUX-style KL
autoencoder. The prompt goes through the tokenizer's chat template, so the tokenizer carries one.

The VAE is diffserve's native `AutoencoderKL` (state dict in Diffusers' names), the text encoder a
transformers `Qwen3Model`; the DiT is diffserve's native class (see `random_native_module`). The scheduler config is the released Z-Image-Turbo one (static shift 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import Qwen3Model

from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    finish_tiny_folder,
    tiny_folder,
    write_autoencoder_kl,
    write_qwen3_text_encoder,
    write_random_module,
    write_scheduler_config,
)

#: The released Z-Image-Turbo scheduler_config.json values: a fixed shift of 3, no resolution dependence.
ZIMAGE_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


@dataclass
class TinyZImageSpec:
    """Shape of a tiny Z-Image checkpoint. Defaults give a ~0.4M-parameter DiT, most of it the
    timestep MLP whose 1024-wide middle layer is fixed by the architecture."""

    dim: int = 32
    n_layers: int = 2
    n_refiner_layers: int = 1
    n_heads: int = 2
    axes_dims: tuple[int, int, int] = (4, 6, 6)
    axes_lens: tuple[int, int, int] = (1536, 512, 512)
    latent_channels: int = 16
    vae_block_out_channels: tuple[int, ...] = (16, 32, 32, 32)
    vae_norm_num_groups: int = 8
    text_hidden_size: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    seed: int = 0


def zimage_model_index() -> dict:
    """The `model_index.json` of a ZImagePipeline folder."""
    return {
        "_class_name": "ZImagePipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def build_tiny_zimage(out_dir: str | Path, spec: TinyZImageSpec | None = None) -> Path:
    """Write a random-weight Z-Image folder to `out_dir` and return its path."""
    spec = spec or TinyZImageSpec()
    root = tiny_folder(out_dir, spec.seed)

    write_qwen3_text_encoder(
        root, Qwen3Model, spec.text_hidden_size, spec.text_layers, spec.text_heads, spec.text_kv_heads
    )

    dit_config = {
        "all_patch_size": [2],
        "all_f_patch_size": [1],
        "in_channels": spec.latent_channels,
        "dim": spec.dim,
        "n_layers": spec.n_layers,
        "n_refiner_layers": spec.n_refiner_layers,
        "n_heads": spec.n_heads,
        "n_kv_heads": spec.n_heads,
        "norm_eps": 1e-5,
        "qk_norm": True,
        "cap_feat_dim": spec.text_hidden_size,
        "rope_theta": 256.0,
        "t_scale": 1000.0,
        "axes_dims": list(spec.axes_dims),
        "axes_lens": list(spec.axes_lens),
    }
    write_random_module(root / "transformer", ZImageTransformer2DModel, dit_config, spec.seed + 10)
    write_autoencoder_kl(root / "vae", spec)
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", ZIMAGE_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, zimage_model_index(), spec)
