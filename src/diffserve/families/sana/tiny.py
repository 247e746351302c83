"""Builder of small random-weight SANA checkpoints in the Diffusers `SanaPipeline` layout.

SANA pairs a Gemma-2 text encoder (its last hidden states; `Gemma2Model`, the decoder of
gemma-2-2b-it) with a linear-attention DiT (`SanaTransformer2DModel`) on the latents of a deep-
compression autoencoder (`AutoencoderDC`, 32x spatial compression in the released f32c32 one). The
DiT and the VAE are written from Diffusers' own classes, so the folder is the reference both
implementations load; the tiny VAE keeps the released layout (six levels, ResBlocks then
EfficientViT blocks, interpolating upsamplers, hence f32) at a few channels per level.

The tokenizer is a `GemmaTokenizer` built in memory: byte fallback for any text, one token per ASCII
character and per word of SANA's instruction, `<bos>` prepended as Gemma's is. The DiT's `sample_size`
picks the aspect-ratio bins resolution binning snaps sizes to (16: the 512 px bins, SANA's smallest), so
a request of 64x96 pixels is generated at 416x608 and resized back, as Diffusers does. The scheduler is
the one SANA's conversion script writes ("flow-dpm_solver"): DPMSolverMultistepScheduler on the flow
path, shift 3. With `sprint=True` the folder is a SanaSprintPipeline one: a guidance-embedding DiT with
QK-norms across heads (sample_size 32, the 1024 px bins) and the SCMScheduler config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diffusers import AutoencoderDC, SanaTransformer2DModel

from diffserve.families.sana.config import SANA_COMPLEX_HUMAN_INSTRUCTION
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    finish_tiny_folder,
    gemma2_text_encoder,
    save_diffusers_model,
    save_text_encoder,
    tiny_folder,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_gemma_tokenizer

#: What scripts/convert_sana_to_diffusers.py writes for SANA's default "flow-dpm_solver" scheduler at
#: 1024px (the other keys are Diffusers' defaults).
SANA_SCHEDULER_CONFIG = {"flow_shift": 3.0, "prediction_type": "flow_prediction", "use_flow_sigmas": True}
#: The released SANA-Sprint scheduler (SCMScheduler), as the same script writes it.
SANA_SPRINT_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "prediction_type": "trigflow",
    "max_timesteps": 1.57080,
    "intermediate_timesteps": 1.3,
    "sigma_data": 0.5,
}


#: The special tokens of Gemma's vocabulary that the tokenizer needs, in Gemma's order (pad 0, eos 1, bos 2).
@dataclass
class TinySanaSpec:
    """Shape of a tiny SANA checkpoint. Defaults give a ~17k-parameter DiT, a ~28k-parameter VAE and a
    ~46k-parameter Gemma-2."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 8
    num_cross_attention_heads: int = 2
    cross_attention_head_dim: int = 8
    #: Transformer `sample_size` in latent pixels: 16, 32, 64 or 128 pick the 512/1024/2048/4096 bins.
    sample_size: int = 16
    latent_channels: int = 8
    vae_block_out_channels: tuple[int, ...] = (4, 8, 8, 8, 8, 8)
    vae_attention_head_dim: int = 8
    vae_scaling_factor: float = 0.41407  # the released DC-AE f32c32's
    text_hidden_size: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    #: Gemma-2 alternates sliding-window and full attention layers; a short window exercises both.
    text_sliding_window: int = 64
    text_max_positions: int = 4096
    #: SANA-Sprint: a guidance-embedding DiT with QK-norms and the SCM scheduler (SanaSprintPipeline);
    #: it needs sample_size 32, the only one SanaSprintPipeline bins sizes for.
    sprint: bool = False
    seed: int = 0


def _dit_config(spec: TinySanaSpec) -> dict:
    inner = spec.num_attention_heads * spec.attention_head_dim
    config = {
        "in_channels": spec.latent_channels,
        "out_channels": spec.latent_channels,
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "num_layers": spec.num_layers,
        "num_cross_attention_heads": spec.num_cross_attention_heads,
        "cross_attention_head_dim": spec.cross_attention_head_dim,
        "cross_attention_dim": inner,
        "caption_channels": spec.text_hidden_size,
        "mlp_ratio": 2.5,
        "dropout": 0.0,
        "attention_bias": False,
        "sample_size": spec.sample_size,
        "patch_size": 1,
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
        "interpolation_scale": None,
        "guidance_embeds": False,
        "guidance_embeds_scale": 0.1,
        "qk_norm": None,
        "timestep_scale": 1.0,
    }
    if spec.sprint:
        config.update(guidance_embeds=True, qk_norm="rms_norm_across_heads")
    return config


def _vae_config(spec: TinySanaSpec) -> dict:
    levels = len(spec.vae_block_out_channels)
    block_types = ["ResBlock"] * (levels // 2) + ["EfficientViTBlock"] * (levels - levels // 2)
    multiscales = [[] if kind == "ResBlock" else [5] for kind in block_types]
    return {
        "in_channels": 3,
        "latent_channels": spec.latent_channels,
        "attention_head_dim": spec.vae_attention_head_dim,
        "encoder_block_types": block_types,
        "decoder_block_types": block_types,
        "encoder_block_out_channels": list(spec.vae_block_out_channels),
        "decoder_block_out_channels": list(spec.vae_block_out_channels),
        "encoder_layers_per_block": [1] * levels,
        "decoder_layers_per_block": [1] * levels,
        "encoder_qkv_multiscales": multiscales,
        "decoder_qkv_multiscales": multiscales,
        "upsample_block_type": "interpolate",
        "downsample_block_type": "Conv",
        "decoder_norm_types": "rms_norm",
        "decoder_act_fns": "silu",
        "encoder_out_shortcut": True,
        "decoder_in_shortcut": True,
        "decoder_conv_act_fn": "relu",
        "scaling_factor": spec.vae_scaling_factor,
    }


def sana_model_index(sprint: bool = False) -> dict:
    """The `model_index.json` of a SanaPipeline (or SanaSprintPipeline) folder."""
    return {
        "_class_name": "SanaSprintPipeline" if sprint else "SanaPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "SCMScheduler" if sprint else "DPMSolverMultistepScheduler"],
        "text_encoder": ["transformers", "Gemma2Model"],
        "tokenizer": ["transformers", "GemmaTokenizer"],
        "transformer": ["diffusers", "SanaTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderDC"],
    }


def build_tiny_sana(out_dir: str | Path, spec: TinySanaSpec | None = None) -> Path:
    """Write a random-weight SANA folder to `out_dir` and return its path."""
    spec = spec or TinySanaSpec()
    if spec.sprint and spec.sample_size != 32:
        raise ValueError(f"SanaSprintPipeline bins sizes for sample_size 32 only, got {spec.sample_size}")
    root = tiny_folder(out_dir, spec.seed)

    tokenizer = build_gemma_tokenizer(SANA_COMPLEX_HUMAN_INSTRUCTION)
    save_text_encoder(root, gemma2_text_encoder(tokenizer, spec), tokenizer)

    dit_config = _dit_config(spec)
    dit = SanaTransformer2DModel.from_config(dit_config)
    save_diffusers_model(dit, root / "transformer", "SanaTransformer2DModel", dit_config)
    vae_config = _vae_config(spec)
    vae = AutoencoderDC.from_config(vae_config)
    save_diffusers_model(vae, root / "vae", "AutoencoderDC", vae_config)

    if spec.sprint:
        write_scheduler_config(root, "SCMScheduler", SANA_SPRINT_SCHEDULER_CONFIG)
    else:
        write_scheduler_config(root, "DPMSolverMultistepScheduler", SANA_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, sana_model_index(spec.sprint), spec)
