"""Builders of small random-weight Wan checkpoints (`WanPipeline`, `WanImageToVideoPipeline`).

Used by the tests, the benchmarks and `diffserve make-tiny wan-t2v` / `wan-i2v` (`--wan-variant`). The
DiT and the causal video VAE are diffserve's native modules (state dicts in Diffusers' names); the UMT5
text encoder and, for Wan 2.1 image-to-video, the CLIP vision encoder and its image processor are
transformers objects. Both diffserve and Diffusers load the folders unchanged.

Variants (`TinyWanSpec.variant`), laid out as the released Diffusers folders:
- "2.1": one DiT; I2V adds CLIP, and with `first_last_frame` the FLF2V DiT's positions over two images.
- "2.2-a14b": two experts (`transformer`, `transformer_2`) and `boundary_ratio` in model_index.json;
  I2V has no image encoder (null in model_index.json) and no image cross-attention.
- "2.2-ti2v": one DiT over Wan 2.2's VAE (z_dim 48, residual levels, 2x2 patches), `expand_timesteps`;
  a `WanPipeline` folder that makes text-to-video and image-to-video.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import (
    CLIPVisionConfig,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    UMT5Config,
    UMT5EncoderModel,
)

from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    save_text_encoder,
    t5_shape,
    tiny_folder,
    vision_tower_shape,
    wan21_vae_config,
    write_clip_image_processor,
    write_json,
    write_random_module,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_t5_tokenizer

#: A flow-match Euler scheduler with Wan 2.1's 480p shift (the released checkpoints ship UniPC with
#: the same flow_shift; see `unipc_scheduler_config`).
FLOW_MATCH_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


@dataclass
class TinyWanSpec:
    """Shape of a tiny Wan 2.1 checkpoint; `image_to_video` adds the CLIP image branch."""

    image_to_video: bool = False
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 24  # split 8/8/8 over frames/rows/cols by Wan's RoPE
    ffn_dim: int = 64
    freq_dim: int = 32
    text_dim: int = 32
    text_layers: int = 2
    vae_base_dim: int = 8
    clip_hidden_size: int = 32
    clip_image_size: int = 32
    #: 8 keeps the tests' 32-pixel CLIP input at 17 image tokens; the released ViT-H/14 at 224 gives 257.
    clip_patch_size: int = 8
    scheduler: str = "flow-match-euler"  # or "unipc" (the released checkpoints' scheduler)
    variant: str = "2.1"  # or "2.2-a14b", "2.2-ti2v" (see the module docstring)
    #: Wan 2.2 A14B: where the low-noise expert takes over (the released T2V folder: 0.875, I2V: 0.9).
    boundary_ratio: float = 0.875
    #: Wan 2.1 image-to-video as FLF2V (Wan2.1-FLF2V-14B): the DiT's `pos_embed_seq_len` covers the CLIP
    #: states of a first and a last frame, so requests send both.
    first_last_frame: bool = False
    dit_weight_noise: float = 0.2
    seed: int = 0


def unipc_scheduler_config(flow_shift: float = 3.0) -> dict:
    """The released Wan2.1-T2V-1.3B-Diffusers scheduler_config.json values."""
    return {
        "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001, "disable_corrector": [],
        "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": flow_shift,
        "lower_order_final": True, "num_train_timesteps": 1000, "predict_x0": True,
        "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False, "sample_max_value": 1.0,
        "solver_order": 2, "solver_p": None, "solver_type": "bh2", "steps_offset": 0, "thresholding": False,
        "timestep_spacing": "linspace", "trained_betas": None, "use_beta_sigmas": False,
        "use_exponential_sigmas": False, "use_flow_sigmas": True, "use_karras_sigmas": False,
    }  # fmt: skip


WAN_VARIANTS = ("2.1", "2.2-a14b", "2.2-ti2v")

#: Wan 2.2's VAE has 48 latent channels; the tiny one uses these statistics (the released ones are
#: Diffusers' config values of Wan2.2-TI2V-5B-Diffusers, which the pipelines read from the folder).
WAN22_Z_DIM = 48
WAN22_LATENTS_MEAN = tuple(round(0.02 * ((i * 7) % 23) - 0.2, 4) for i in range(WAN22_Z_DIM))
WAN22_LATENTS_STD = tuple(round(0.4 + 0.05 * ((i * 5) % 17), 4) for i in range(WAN22_Z_DIM))


def wan_model_index(image_to_video: bool, scheduler_class: str, spec: TinyWanSpec | None = None) -> dict:
    spec = spec or TinyWanSpec(image_to_video=image_to_video)
    index: dict = {
        "_class_name": "WanImageToVideoPipeline" if image_to_video else "WanPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", scheduler_class],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if spec.variant == "2.2-a14b":
        index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
        index["boundary_ratio"] = spec.boundary_ratio
        index["expand_timesteps"] = False
    elif spec.variant == "2.2-ti2v":
        index["transformer_2"] = [None, None]
        index["boundary_ratio"] = None
        index["expand_timesteps"] = True
    if image_to_video and spec.variant == "2.1":
        index["image_encoder"] = ["transformers", "CLIPVisionModel"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    elif image_to_video:
        index["image_encoder"] = [None, None]
        index["image_processor"] = [None, None]
    return index


def _write_text_encoder(root: Path, spec: TinyWanSpec) -> None:
    tokenizer = build_t5_tokenizer(512)
    shape = t5_shape(len(tokenizer), spec.text_dim, spec.text_layers)
    config = UMT5Config(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    save_text_encoder(root, UMT5EncoderModel(config), tokenizer)


def _write_image_encoder(
    root: Path,
    spec: TinyWanSpec,
    encoder_cls: type[CLIPVisionModel] | type[CLIPVisionModelWithProjection] = CLIPVisionModel,
) -> None:
    """`image_encoder/`, a tiny CLIP vision tower of `encoder_cls` (Wan 2.1's `CLIPVisionModel`, SkyReels-V2's
    with projection), and its `image_processor/`."""
    shape = vision_tower_shape(spec.clip_hidden_size, spec.clip_image_size, spec.clip_patch_size)
    encoder = encoder_cls(CLIPVisionConfig(**shape, projection_dim=spec.clip_hidden_size))
    encoder.save_pretrained(root / "image_encoder")
    write_clip_image_processor(root / "image_processor", spec.clip_image_size)


def _dit_config(spec: TinyWanSpec) -> dict:
    inner = spec.num_attention_heads * spec.attention_head_dim
    clip = spec.image_to_video and spec.variant == "2.1"
    if spec.variant == "2.2-ti2v":
        in_channels = out_channels = WAN22_Z_DIM
    else:  # I2V: noise 16 + mask 4 + image latents 16
        in_channels, out_channels = (36 if spec.image_to_video else 16), 16
    config = {
        "patch_size": [1, 2, 2],
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "text_dim": spec.text_dim,
        "freq_dim": spec.freq_dim,
        "ffn_dim": spec.ffn_dim,
        "num_layers": spec.num_layers,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": spec.clip_hidden_size if clip else None,
        "added_kv_proj_dim": inner if clip else None,
        "rope_max_seq_len": 1024,
    }
    if clip and spec.first_last_frame:
        config["pos_embed_seq_len"] = 2 * clip_tokens(spec)
    return config


def clip_tokens(spec: TinyWanSpec) -> int:
    """The tiny CLIP vision tower's states per image: its patches and the class token."""
    return (spec.clip_image_size // spec.clip_patch_size) ** 2 + 1


def _vae_config(spec: TinyWanSpec) -> dict:
    config = wan21_vae_config(spec.vae_base_dim)
    if spec.variant == "2.2-ti2v":  # Wan 2.2's layout: 2x2 patches of RGB into 12 channels, 16x in all
        config.update(
            decoder_base_dim=spec.vae_base_dim * 3 // 2,
            z_dim=WAN22_Z_DIM,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=list(WAN22_LATENTS_MEAN),
            latents_std=list(WAN22_LATENTS_STD),
        )
    return config


def build_tiny_wan(out_dir: str | Path, spec: TinyWanSpec | None = None) -> Path:
    """Write a random-weight Wan folder (T2V, or I2V with `spec.image_to_video`, of `spec.variant`); return
    its path."""
    spec = spec or TinyWanSpec()
    if spec.variant not in WAN_VARIANTS:
        raise ValueError(f"unknown Wan variant {spec.variant!r}; one of {', '.join(WAN_VARIANTS)}")
    if spec.first_last_frame and not (spec.image_to_video and spec.variant == "2.1"):
        raise ValueError("first_last_frame is a Wan 2.1 image-to-video folder (FLF2V): set image_to_video")
    if spec.variant == "2.2-ti2v" and spec.image_to_video:
        raise ValueError(
            "Wan 2.2 TI2V is one WanPipeline folder for both tasks: build it without image_to_video"
        )
    root = tiny_folder(out_dir, spec.seed)
    _write_text_encoder(root, spec)
    dit_config = _dit_config(spec)
    write_random_module(
        root / "transformer", WanTransformer3DModel, dit_config, spec.seed + 10, spec.dit_weight_noise
    )
    if spec.variant == "2.2-a14b":  # the low-noise expert: same shape, its own weights
        write_random_module(
            root / "transformer_2", WanTransformer3DModel, dit_config, spec.seed + 30, spec.dit_weight_noise
        )
    write_random_module(root / "vae", AutoencoderKLWan, _vae_config(spec), spec.seed + 20)
    if spec.image_to_video and spec.variant == "2.1":
        _write_image_encoder(root, spec)
    if spec.scheduler == "unipc":
        scheduler_class, scheduler_config = "UniPCMultistepScheduler", unipc_scheduler_config()
    else:
        scheduler_class, scheduler_config = "FlowMatchEulerDiscreteScheduler", FLOW_MATCH_SCHEDULER_CONFIG
    write_scheduler_config(root, scheduler_class, scheduler_config, newline=True)
    index = wan_model_index(spec.image_to_video, scheduler_class, spec)
    write_json(root / "model_index.json", index, newline=True)
    return root
