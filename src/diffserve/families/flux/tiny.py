"""Builder of small random-weight FLUX.1 checkpoints in the Diffusers `FluxPipeline` layout.

Used by the tests, the benchmarks and `diffserve make-tiny flux`. The DiT and VAE are diffserve's
native modules (their state dicts use Diffusers' names), the text encoders are transformers
models; the folder loads unchanged in both diffserve and diffusers' `FluxPipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import CLIPTextModel, T5EncoderModel

from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    RESOLUTION_SHIFT_SCHEDULER_CONFIG,
    clip_text_config,
    double_single_stream_dit_config,
    finish_tiny_folder,
    save_diffusers_model,
    save_text_encoder,
    t5_encoder_config,
    tiny_folder,
    write_autoencoder_kl,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_clip_tokenizer, build_t5_tokenizer

#: The released FLUX.1 scheduler_config.json values (resolution-dependent shift).
FLUX_SCHEDULER_CONFIG = RESOLUTION_SHIFT_SCHEDULER_CONFIG


@dataclass
class TinyFluxSpec:
    """Shape of a tiny FLUX checkpoint. Defaults give a ~0.1M-parameter DiT that runs in milliseconds."""

    num_layers: int = 1
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    guidance_embeds: bool = True
    latent_channels: int = 16
    vae_block_out_channels: tuple[int, ...] = (16, 32, 32, 32)
    vae_norm_num_groups: int = 8
    text_hidden_size: int = 32
    text_layers: int = 2
    t5_max_length: int = 512
    seed: int = 0
    extra_dit_config: dict = field(default_factory=dict)


def flux_model_index(
    clip_tokenizer_class: str = "CLIPTokenizer", t5_tokenizer_class: str = "T5TokenizerFast"
) -> dict:
    """The `model_index.json` of a FluxPipeline folder."""
    return {
        "_class_name": "FluxPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", clip_tokenizer_class],
        "tokenizer_2": ["transformers", t5_tokenizer_class],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def build_tiny_flux(out_dir: str | Path, spec: TinyFluxSpec | None = None) -> Path:
    """Write a random-weight FLUX.1 folder to `out_dir` and return its path."""
    spec = spec or TinyFluxSpec()
    root = tiny_folder(out_dir, spec.seed)

    clip_tokenizer = build_clip_tokenizer()
    t5_tokenizer = build_t5_tokenizer(spec.t5_max_length)
    clip = CLIPTextModel(clip_text_config(clip_tokenizer, spec.text_hidden_size, spec.text_layers))
    t5 = T5EncoderModel(t5_encoder_config(t5_tokenizer, spec.text_hidden_size, spec.text_layers))
    save_text_encoder(root, clip, clip_tokenizer)
    save_text_encoder(root, t5, t5_tokenizer, "_2")

    dit_config = {
        **double_single_stream_dit_config(spec, spec.text_hidden_size),
        "pooled_projection_dim": spec.text_hidden_size,
        "guidance_embeds": spec.guidance_embeds,
        "axes_dims_rope": list(spec.axes_dims_rope),
        **spec.extra_dit_config,
    }
    dit = FluxTransformer2DModel.from_config(dit_config)
    save_diffusers_model(dit, root / "transformer", "FluxTransformer2DModel", dit_config)

    write_autoencoder_kl(root / "vae", spec)
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", FLUX_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, flux_model_index(), spec)


def flux_dit_inputs(
    grid_h: int,
    grid_w: int,
    text_len: int,
    timesteps: list[float],
    in_channels: int = 16,
    context_dim: int = 24,
    pooled_dim: int = 12,
    seed: int = 1,
) -> dict[str, torch.Tensor]:
    """Keyword inputs of `FluxTransformer2DModel.forward` for a batch of len(timesteps) rows on a
    grid_h x grid_w latent grid (position ids on the grid, as the pipeline makes them) and `text_len`
    text tokens, drawn from `seed`; for the DiT-level parity tests of the parallel modes."""
    g = torch.Generator().manual_seed(seed)
    batch = len(timesteps)
    img_ids = torch.zeros(grid_h, grid_w, 3)
    img_ids[..., 1] = torch.arange(grid_h)[:, None]
    img_ids[..., 2] = torch.arange(grid_w)[None, :]
    return {
        "hidden_states": torch.randn(batch, grid_h * grid_w, in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, text_len, context_dim, generator=g),
        "pooled_projections": torch.randn(batch, pooled_dim, generator=g),
        "timestep": torch.tensor(timesteps),
        "guidance": torch.full((batch,), 3.5),
        "img_ids": img_ids.reshape(-1, 3),
        "txt_ids": torch.zeros(text_len, 3),
    }
