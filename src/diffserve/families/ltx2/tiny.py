"""Builder of small random-weight LTX-2 checkpoints in the Diffusers `LTX2Pipeline` /
`LTX2ImageToVideoPipeline` layout (used by the tests and `diffserve make-tiny ltx2-t2v` / `ltx2-i2v`).

LTX-2 generates a video and its soundtrack together: a Gemma-3 text encoder (every layer's hidden states,
stacked) feeds two text connectors (one per modality), a joint audio-video DiT denoises packed video latents
and packed audio-spectrogram latents side by side, and the video VAE, the audio VAE and a vocoder turn them
into frames and a waveform. The folder is written by Diffusers' own classes (and transformers' Gemma-3), so
it is the reference both implementations load. The layout follows the released checkpoint where it
matters to the pipeline: a video VAE with 32x spatial and 8x temporal compression (frames 8k+1, sizes
multiples of 32), the audio VAE's fixed 4x time and mel compression at 16 kHz with hop 160, learnable
registers in the connectors (so `max_sequence_length` must be a multiple of their count), "split" RoPE.
Every weight and the VAEs' latent statistics are random, so no term of the pipeline reads as zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from diffserve.testing.tiny_writing import vision_tower_shape
from diffserve.testing.tokenizers import build_gemma_tokenizer

#: The prompt words the tiny tokenizer knows whole (others are spelled letter by letter).
_WORDS = ("a robot dancing in the rain with music and a cat playing piano at night",)


@dataclass
class TinyLTX2Spec:
    """Shape of a tiny LTX-2 checkpoint; `image_to_video` writes an `LTX2ImageToVideoPipeline` folder."""

    image_to_video: bool = False
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 8
    audio_num_attention_heads: int = 2
    audio_attention_head_dim: int = 4
    latent_channels: int = 8
    #: Audio latents: channels x (mel_bins / 4) values per time step, which must equal the audio VAE's
    #: `base_channels` (its latent statistics are that long).
    audio_latent_channels: int = 2
    mel_bins: int = 16
    text_hidden_size: int = 32
    text_layers: int = 2
    connector_registers: int = 8
    vae_channels: int = 8
    #: The video VAE's decoder takes the decode timestep (`decode_timestep`, `decode_noise_scale`). Diffusers'
    #: decoder cannot run it when an up block's first resnet changes the channel count, as the released
    #: channel ratios make it do, so this variant's decoder keeps one width and upsamples without
    #: channel reduction.
    timestep_conditioning: bool = False
    seed: int = 0
    #: Every weight gets this much Gaussian noise on top of Diffusers' initialisation (some of which is zero).
    weight_noise: float = 0.05
    #: Diffusers config keys that override (or add to) what the builder passes each component's class:
    #: other checkpoints' configs (layouts, RoPE, VAE depths, audio rates, scheduler shifts ...).
    extra_transformer_config: dict = field(default_factory=dict)
    extra_connectors_config: dict = field(default_factory=dict)
    extra_vae_config: dict = field(default_factory=dict)
    extra_audio_vae_config: dict = field(default_factory=dict)
    extra_vocoder_config: dict = field(default_factory=dict)
    extra_scheduler_config: dict = field(default_factory=dict)


def _gemma3(
    spec: TinyLTX2Spec, vocab_size: int, pad: int, bos: int, eos: int
) -> Gemma3ForConditionalGeneration:
    heads = 2
    text = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=spec.text_hidden_size,
        intermediate_size=spec.text_hidden_size * 2,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=spec.text_hidden_size // heads,
        query_pre_attn_scalar=spec.text_hidden_size // heads,
        sliding_window=16,
        max_position_embeddings=4096,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    vision = SiglipVisionConfig(**vision_tower_shape(16, image_size=28, patch_size=14, num_layers=1))
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    return Gemma3ForConditionalGeneration(config).eval()


def _perturb(module: torch.nn.Module, scale: float, seed: int) -> None:
    """Add Gaussian noise of std `scale` to every parameter, in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)


def _random_statistics(vae: torch.nn.Module, seed: int) -> None:
    """Non-trivial latent mean/std buffers (Diffusers initialises them to 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        n = vae.latents_mean.shape[0]
        vae.latents_mean.copy_(torch.randn(n, generator=generator) * 0.2)
        vae.latents_std.copy_(0.5 + torch.rand(n, generator=generator))


def build_tiny_ltx2_pipeline(spec: TinyLTX2Spec | None = None):
    """The random-weight Diffusers pipeline object (`LTX2Pipeline` or `LTX2ImageToVideoPipeline`)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2ImageToVideoPipeline,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    spec = spec or TinyLTX2Spec()
    torch.manual_seed(spec.seed)
    tokenizer = build_gemma_tokenizer(_WORDS)
    text_encoder = _gemma3(
        spec, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    audio_in = spec.audio_latent_channels * (spec.mel_bins // 4)
    transformer = LTX2VideoTransformer3DModel(
        **{
            "in_channels": spec.latent_channels,
            "out_channels": spec.latent_channels,
            "patch_size": 1,
            "patch_size_t": 1,
            "num_attention_heads": spec.num_attention_heads,
            "attention_head_dim": spec.attention_head_dim,
            "cross_attention_dim": spec.num_attention_heads * spec.attention_head_dim,
            "audio_in_channels": audio_in,
            "audio_out_channels": audio_in,
            "audio_num_attention_heads": spec.audio_num_attention_heads,
            "audio_attention_head_dim": spec.audio_attention_head_dim,
            "audio_cross_attention_dim": spec.audio_num_attention_heads * spec.audio_attention_head_dim,
            "num_layers": spec.num_layers,
            "caption_channels": spec.text_hidden_size,
            "rope_type": "split",
            "perturbed_attn": True,  # LTX-2.3's STG-perturbable self-attention
            **spec.extra_transformer_config,
        }
    )
    connectors = LTX2TextConnectors(
        **{
            "caption_channels": spec.text_hidden_size,
            "text_proj_in_factor": spec.text_layers + 1,
            "video_connector_num_attention_heads": 2,
            "video_connector_attention_head_dim": spec.text_hidden_size // 2,
            "video_connector_num_layers": 1,
            "video_connector_num_learnable_registers": spec.connector_registers,
            "audio_connector_num_attention_heads": 2,
            "audio_connector_attention_head_dim": spec.text_hidden_size // 2,
            "audio_connector_num_layers": 1,
            "audio_connector_num_learnable_registers": spec.connector_registers,
            "rope_type": "split",
            **spec.extra_connectors_config,
        }
    )
    c = spec.vae_channels
    decoder: dict = {"decoder_block_out_channels": (c, 2 * c, 4 * c)}  # the released channel ratios
    if spec.timestep_conditioning:
        decoder = {
            "decoder_block_out_channels": (4 * c,) * 3,
            "upsample_factor": (1, 1, 1),
            "upsample_residual": (False, False, False),
        }
    vae = AutoencoderKLLTX2Video(
        **{
            "latent_channels": spec.latent_channels,
            "block_out_channels": (c, 2 * c, 4 * c, 8 * c),
            "layers_per_block": (1, 1, 1, 1, 1),
            "decoder_layers_per_block": (1, 1, 1, 1),
            "timestep_conditioning": spec.timestep_conditioning,
            **decoder,
            "decoder_causal": False,
            # LTX-2's 32x / 8x: one spatial-only and one temporal-only level besides two spatiotemporal ones
            # (the formula from `spatio_temporal_scaling` would count all four levels in both).
            "spatial_compression_ratio": 32,
            "temporal_compression_ratio": 8,
            **spec.extra_vae_config,
        }
    )
    audio_vae = AutoencoderKLLTX2Audio(
        **{
            "base_channels": audio_in,
            "ch_mult": (1, 2),
            "num_res_blocks": 1,
            "resolution": 32,
            "latent_channels": spec.audio_latent_channels,
            "mel_bins": spec.mel_bins,
            **spec.extra_audio_vae_config,
        }
    )
    vocoder = LTX2Vocoder(  # the released upsampling (240 samples a mel frame: 24 kHz from hop 160 at 16 kHz)
        **{
            "in_channels": audio_vae.config.output_channels * spec.mel_bins,
            "hidden_channels": 32,
            "out_channels": 2,
            "upsample_kernel_sizes": [16, 15, 8, 4, 4],
            "upsample_factors": [6, 5, 2, 2, 2],
            "resnet_kernel_sizes": [3],
            "resnet_dilations": [[1, 3]],
            "output_sampling_rate": 24000,
            **spec.extra_vocoder_config,
        }
    )
    for offset, module in enumerate((transformer, connectors, vae, audio_vae, vocoder)):
        _perturb(module, spec.weight_noise, spec.seed + 10 + offset)
    _random_statistics(vae, spec.seed + 20)
    _random_statistics(audio_vae, spec.seed + 21)
    cls = LTX2ImageToVideoPipeline if spec.image_to_video else LTX2Pipeline
    # The shift settings LTX2Pipeline falls back to when a scheduler config lacks them, and a terminal sigma.
    scheduler = FlowMatchEulerDiscreteScheduler(
        **{
            "use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
            "max_image_seq_len": 4096, "shift_terminal": 0.1, **spec.extra_scheduler_config,
        }
    )  # fmt: skip
    return cls(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )


def build_tiny_ltx2(out_dir: str | Path, spec: TinyLTX2Spec | None = None) -> Path:
    """Write a random-weight LTX-2 folder (T2V, or I2V with `spec.image_to_video`); return its path."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    build_tiny_ltx2_pipeline(spec).save_pretrained(str(root))
    return root
