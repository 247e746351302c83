"""Builders of small random-weight Qwen-Image checkpoints in the Diffusers layouts.

Four folder kinds share the same components and differ in `model_index.json` (Layered, also in two configs):

* `QwenImagePipeline` (text to image): a Qwen2.5-VL text encoder whose last hidden state conditions
  an MMDiT, a 16-channel causal-3D VAE (`AutoencoderKLQwenImage`, 8x spatial compression, latents
  normalised per channel with `latents_mean`/`latents_std`), a byte-level Qwen tokenizer;
* `QwenImageEditPipeline`: the same plus `processor` (`Qwen2VLProcessor`), because the edit pipeline
  shows the input image to the vision-language encoder as well as VAE-encoding it into the DiT input;
* `QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509 style, several input images): same files as Edit.
* `QwenImageLayeredPipeline` (an image decomposed into RGBA layers): the files of Edit, with a VAE of
  four pixel channels (RGBA) and a DiT with layer-aware RoPE and the additional timestep embedding.

The text encoder is a full `Qwen2_5_VLForConditionalGeneration` (the pipelines load that class), with
a tiny vision tower; the DiT's `joint_attention_dim` equals its text hidden size. The DiT and VAE
weights are made with diffserve's native classes (see `random_native_module`).
The scheduler config carries the values of the released Qwen-Image scheduler (exponential time
shift, resolution-dependent `mu`, terminal shift), so timestep schedules match the real model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.vaes.autoencoder_kl_qwen_image import AutoencoderKLQwenImage
from diffserve.models.vaes.causal3d_blocks import LATENTS_MEAN, LATENTS_STD
from diffserve.testing.qwen_processors import load_qwen_vl_processor as load_qwen_vl_processor
from diffserve.testing.qwen_processors import write_qwen_vl_processor
from diffserve.testing.qwen_tokenizers import build_qwen_tokenizer
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    check_variant,
    finish_tiny_folder,
    qwen2_5_vl_encoder,
    save_text_encoder,
    tiny_folder,
    write_random_module,
    write_scheduler_config,
)

#: The released Qwen-Image scheduler_config.json values (Qwen-Image-Edit and -Edit-2509 ship the same).
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

PIPELINE_CLASSES = {
    "t2i": "QwenImagePipeline",
    "edit": "QwenImageEditPipeline",
    "edit_plus": "QwenImageEditPlusPipeline",
    "layered": "QwenImageLayeredPipeline",
}


@dataclass
class TinyQwenImageSpec:
    """Shape of a tiny Qwen-Image checkpoint. Defaults give a ~0.12M-parameter DiT.

    `variant` picks the pipeline: "t2i", "edit", "edit_plus" or "layered". `image_max_pixels` caps the
    picture the vision tower sees (the real processor allows 12.8M pixels; a small cap keeps the tower's
    sequence to a few dozen patches whatever size the edit pipelines resize the input to).
    """

    variant: str = "t2i"
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    zero_cond_t: bool = False
    vae_base_dim: int = 4
    vae_dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    vae_num_res_blocks: int = 1
    text_hidden_size: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    vision_hidden_size: int = 16
    vision_depth: int = 2
    image_max_pixels: int = 28 * 28 * 16
    seed: int = 0


def qwen_image_model_index(variant: str = "t2i") -> dict:
    """The `model_index.json` of a Qwen-Image / -Edit / -Edit-Plus / -Layered folder."""
    index = {
        "_class_name": PIPELINE_CLASSES[variant],
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    if variant != "t2i":
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    return index


def build_tiny_qwen_image(out_dir: str | Path, spec: TinyQwenImageSpec | None = None) -> Path:
    """Write a random-weight Qwen-Image folder (`spec.variant` picks t2i / edit / edit_plus / layered); return
    its path."""
    spec = spec or TinyQwenImageSpec()
    check_variant("Qwen-Image", spec.variant, PIPELINE_CLASSES)
    root = tiny_folder(out_dir, spec.seed)

    tokenizer = build_qwen_tokenizer()
    encoder = qwen2_5_vl_encoder(
        spec, tokenizer, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112
    )
    save_text_encoder(root, encoder, tokenizer)
    if spec.variant != "t2i":
        write_qwen_vl_processor(root / "processor", tokenizer, max_pixels=spec.image_max_pixels)

    latent_channels = 16
    layered = spec.variant == "layered"
    dit_config = {
        "patch_size": 2,
        "in_channels": latent_channels * 4,
        "out_channels": latent_channels,
        "num_layers": spec.num_layers,
        "attention_head_dim": spec.attention_head_dim,
        "num_attention_heads": spec.num_attention_heads,
        "joint_attention_dim": spec.text_hidden_size,
        "guidance_embeds": False,
        "axes_dims_rope": list(spec.axes_dims_rope),
        "zero_cond_t": spec.zero_cond_t,
        "use_additional_t_cond": layered,
        "use_layer3d_rope": layered,
    }
    write_random_module(root / "transformer", QwenImageTransformer2DModel, dit_config, spec.seed + 10, 0.2)

    vae_config = {
        "base_dim": spec.vae_base_dim,
        "z_dim": latent_channels,
        "dim_mult": list(spec.vae_dim_mult),
        "num_res_blocks": spec.vae_num_res_blocks,
        "attn_scales": [],
        "temperal_downsample": [False] + [True] * (len(spec.vae_dim_mult) - 2),
        "dropout": 0.0,
        "input_channels": 4 if layered else 3,
        "latents_mean": list(LATENTS_MEAN),
        "latents_std": list(LATENTS_STD),
    }
    write_random_module(root / "vae", AutoencoderKLQwenImage, vae_config, spec.seed + 20)

    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", QWEN_IMAGE_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, qwen_image_model_index(spec.variant), spec)


def build_tiny_qwen_image_edit(out_dir: str | Path, spec: TinyQwenImageSpec | None = None) -> Path:
    """A Qwen-Image-Edit folder: `build_tiny_qwen_image` with `variant="edit"`."""
    return build_tiny_qwen_image(out_dir, replace(spec or TinyQwenImageSpec(), variant="edit"))


def build_tiny_qwen_image_edit_plus(out_dir: str | Path, spec: TinyQwenImageSpec | None = None) -> Path:
    """A Qwen-Image-Edit-Plus (2509-style, multi-image) folder: `variant="edit_plus"`."""
    return build_tiny_qwen_image(out_dir, replace(spec or TinyQwenImageSpec(), variant="edit_plus"))


def build_tiny_qwen_image_layered(out_dir: str | Path, spec: TinyQwenImageSpec | None = None) -> Path:
    """A Qwen-Image-Layered folder (RGBA VAE, layer-aware DiT): `variant="layered"`."""
    return build_tiny_qwen_image(out_dir, replace(spec or TinyQwenImageSpec(), variant="layered"))
