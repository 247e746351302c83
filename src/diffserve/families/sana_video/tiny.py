"""Builder of small random-weight SANA-Video checkpoints in the Diffusers `SanaVideoPipeline` layout.

A Gemma-2 text encoder (`Gemma2Model`) with an in-memory `GemmaTokenizer` (byte fallback, one token per
word of the video instruction, `<bos>` first), the native SANA-Video DiT (`SanaVideoTransformer3DModel`,
state dict in Diffusers' names, every weight noised so the text matters), Wan 2.1's causal VAE
(`AutoencoderKLWan`, 8x spatial and 4x temporal compression) and the flow DPM-Solver++ scheduler the
released folders ship (`DPMSolverMultistepScheduler`, flow sigmas, shift 8). The DiT's `sample_size` is
30, the 480p bins: a request leaving `use_resolution_binning` on is generated at 480p and resized back,
so the tests turn it off. `vae="ltx2-video"` writes LTX-2's video VAE instead (as the 720p folders ship).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from diffserve.families.sana_video.config import SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION
from diffserve.models.dits.sana_video import SanaVideoTransformer3DModel
from diffserve.models.vaes.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    check_variant,
    finish_tiny_folder,
    gemma2_text_encoder,
    random_native_module,
    save_diffusers_model,
    save_text_encoder,
    tiny_folder,
    wan21_vae_config,
    write_random_module,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_gemma_tokenizer

#: The released SANA-Video 480p folder's scheduler (DPM-Solver++ on the flow path); other keys default.
SANA_VIDEO_SCHEDULER_CONFIG = {
    "flow_shift": 8.0,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
}


@dataclass
class TinySanaVideoSpec:
    """Shape of a tiny SANA-Video checkpoint."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 12  # RoPE: 4 / 4 / 4 over frames / rows / columns
    cross_attention_head_dim: int = 12
    sample_size: int = 30  # the 480p bins
    vae_base_dim: int = 8
    text_hidden_size: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    text_sliding_window: int = 64
    text_max_positions: int = 4096
    dit_weight_noise: float = 0.2
    #: "wan" (Wan 2.1's VAE, the 480p folders') or "ltx2-video" (LTX-2's video VAE, the 720p folders': 32x, 8x).
    vae: str = "wan"
    patch_size: tuple[int, int, int] = (1, 2, 2)
    seed: int = 0


def _dit_config(spec: TinySanaVideoSpec) -> dict:
    inner = spec.num_attention_heads * spec.attention_head_dim
    return {
        "in_channels": 16,
        "out_channels": 16,
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "num_layers": spec.num_layers,
        "num_cross_attention_heads": inner // spec.cross_attention_head_dim,
        "cross_attention_head_dim": spec.cross_attention_head_dim,
        "cross_attention_dim": inner,
        "caption_channels": spec.text_hidden_size,
        "mlp_ratio": 2.5,
        "dropout": 0.0,
        "attention_bias": False,
        "sample_size": spec.sample_size,
        "patch_size": list(spec.patch_size),
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
        "interpolation_scale": None,
        "guidance_embeds": False,
        "guidance_embeds_scale": 0.1,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 1024,
    }


def _ltx2_vae_config() -> dict:
    """A small LTX-2 video VAE with the released layout's 32x spatial and 8x temporal compression."""
    c = 8
    return {
        "latent_channels": 16,
        "block_out_channels": [c, 2 * c, 4 * c, 8 * c],
        "decoder_block_out_channels": [c, 2 * c, 4 * c],
        "layers_per_block": [1, 1, 1, 1, 1],
        "decoder_layers_per_block": [1, 1, 1, 1],
        "decoder_causal": False,
        "timestep_conditioning": False,
        "spatial_compression_ratio": 32,
        "temporal_compression_ratio": 8,
    }


def _write_ltx2_vae(root: Path, spec: TinySanaVideoSpec) -> None:
    config = _ltx2_vae_config()
    vae = random_native_module(AutoencoderKLLTX2Video, config, spec.seed + 20)
    generator = torch.Generator().manual_seed(spec.seed + 21)
    with torch.no_grad():  # non-trivial latent statistics (they start at 0 and 1)
        n = vae.latents_mean.shape[0]
        vae.latents_mean.copy_(torch.randn(n, generator=generator) * 0.2)
        vae.latents_std.copy_(0.5 + torch.rand(n, generator=generator))
    save_diffusers_model(vae, root / "vae", "AutoencoderKLLTX2Video", config)


def sana_video_model_index(vae: str = "wan") -> dict:
    """The `model_index.json` of a SanaVideoPipeline folder."""
    return {
        "_class_name": "SanaVideoPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],
        "text_encoder": ["transformers", "Gemma2Model"],
        "tokenizer": ["transformers", "GemmaTokenizer"],
        "transformer": ["diffusers", "SanaVideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLLTX2Video" if vae == "ltx2-video" else "AutoencoderKLWan"],
    }


def build_tiny_sana_video(out_dir: str | Path, spec: TinySanaVideoSpec | None = None) -> Path:
    """Write a random-weight SANA-Video folder to `out_dir` and return its path."""
    spec = spec or TinySanaVideoSpec()
    check_variant("SANA-Video VAE", spec.vae, ("wan", "ltx2-video"))
    root = tiny_folder(out_dir, spec.seed)
    tokenizer = build_gemma_tokenizer(SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION)
    save_text_encoder(root, gemma2_text_encoder(tokenizer, spec), tokenizer)
    write_random_module(
        root / "transformer",
        SanaVideoTransformer3DModel,
        _dit_config(spec),
        spec.seed + 10,
        spec.dit_weight_noise,
    )
    if spec.vae == "ltx2-video":
        _write_ltx2_vae(root, spec)
    else:
        write_random_module(
            root / "vae", AutoencoderKLWan, wan21_vae_config(spec.vae_base_dim), spec.seed + 20
        )
    write_scheduler_config(root, "DPMSolverMultistepScheduler", SANA_VIDEO_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, sana_video_model_index(spec.vae), spec)
