"""What every tiny-checkpoint builder writes with: the folder and its JSON files, Diffusers config bodies,
`save_pretrained`-style model folders, randomly initialised native modules, the shared random VAE folders
and the shapes of the tiny transformers text and vision encoders several families use (Gemma-2, Llama,
Qwen, T5, CLIP), the image-to-video folders' CLIP image processor and the tiny Wan 2.1 VAE config (Wan's
own folders and SANA-Video's ship that VAE)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    Gemma2Config,
    Gemma2Model,
    GemmaTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    T5Config,
)

from diffserve.loader.native_classes import NativeModelClass
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.models.vaes.causal3d_blocks import LATENTS_MEAN, LATENTS_STD
from diffserve.testing.qwen_tokenizers import build_qwen_tokenizer

#: Written as `_diffusers_version` so diffusers recognises the files; not a runtime requirement.
DIFFUSERS_FORMAT_VERSION = "0.32.0"

#: The released FLUX.1 scheduler_config.json values: FlowMatchEuler with the shift growing with the image's
#: token count. The FLUX-derived families (Chroma, LongCat-Image; FLUX.2 with keys of its own after these)
#: ship the same, so their builders write this one mapping.
RESOLUTION_SHIFT_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def tiny_folder(out_dir: str | Path, seed: int) -> Path:
    """The folder a builder writes to, created if missing, with torch's global generator seeded by `seed`
    (the transformers encoders draw their initial weights from it)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    return root


def check_variant(family: str, variant: str, variants: Iterable[str]) -> None:
    """A builder's ValueError for a `variant` that is not one of `variants` (naming them)."""
    if variant not in variants:
        raise ValueError(f"unknown {family} variant {variant!r}; expected one of {sorted(variants)}")


def write_json(path: Path, body: object, newline: bool = False) -> None:
    """`body` as JSON indented by two at `path` (its folder created), with a final line break or not (the
    builders differ in that, and their files stay as they were)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + ("\n" if newline else ""))


def write_scheduler_config(root: Path, class_name: str, config: dict, newline: bool = False) -> None:
    """`scheduler/scheduler_config.json`: the Diffusers config body of the scheduler `class_name`."""
    write_json(root / "scheduler" / "scheduler_config.json", diffusers_config(class_name, config), newline)


def finish_tiny_folder(root: Path, model_index: dict, spec: Any) -> Path:
    """Write `model_index.json` and `diffserve_tiny_spec.json` (the dataclass `spec` the folder was built
    from) and return `root`."""
    write_json(root / "model_index.json", model_index)
    write_json(root / "diffserve_tiny_spec.json", asdict(spec))
    return root


def diffusers_config(class_name: str, config: dict) -> dict:
    """A Diffusers config.json body: the class and format version first, tuples written as lists."""
    out = {"_class_name": class_name, "_diffusers_version": DIFFUSERS_FORMAT_VERSION}
    out.update({k: list(v) if isinstance(v, tuple) else v for k, v in config.items()})
    return out


def save_diffusers_model(module: nn.Module, directory: Path, class_name: str, config: dict) -> None:
    """Write `config.json` and `diffusion_pytorch_model.safetensors` as Diffusers' save_pretrained does."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(diffusers_config(class_name, config), indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(directory / "diffusion_pytorch_model.safetensors"))


def autoencoder_kl_config(
    block_out_channels: tuple[int, ...],
    latent_channels: int,
    norm_groups: int,
    scaling_factor: float,
    shift_factor: float,
) -> dict:
    """The config of a small `AutoencoderKL`: one layer per level, no quant convs (SD3's and FLUX.1's)."""
    n_levels = len(block_out_channels)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * n_levels,
        "up_block_types": ["UpDecoderBlock2D"] * n_levels,
        "block_out_channels": list(block_out_channels),
        "layers_per_block": 1,
        "act_fn": "silu",
        "latent_channels": latent_channels,
        "norm_num_groups": norm_groups,
        "sample_size": 64,
        "scaling_factor": scaling_factor,
        "shift_factor": shift_factor,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }


class AutoencoderKLSpec(Protocol):
    """The fields of a tiny spec that shape its FLUX.1-kind `AutoencoderKL`."""

    latent_channels: int
    vae_block_out_channels: tuple[int, ...]
    vae_norm_num_groups: int


def write_autoencoder_kl(directory: Path, spec: AutoencoderKLSpec) -> None:
    """A random `AutoencoderKL` of `spec`'s shape with FLUX.1's scaling and shift (the VAE FLUX.1, Chroma,
    LongCat-Image and Z-Image folders ship)."""
    vae_config = autoencoder_kl_config(
        spec.vae_block_out_channels, spec.latent_channels, spec.vae_norm_num_groups, 0.3611, 0.1159
    )
    vae_config["force_upcast"] = True
    save_diffusers_model(AutoencoderKL.from_config(vae_config), directory, "AutoencoderKL", vae_config)


def random_native_module(
    cls: NativeModelClass, config: dict, seed: int, weight_noise: float = 0.0
) -> nn.Module:
    """The native module `cls` built from a Diffusers `config`, randomly initialised under `seed`.

    Parameters that start at zero get small noise, so learned pad tokens and zero-initialised
    projections are not hidden from parity tests. `weight_noise` adds N(0, weight_noise) to every
    parameter: a random DiT is otherwise nearly blind to its text, and CFG parity would prove little.
    """
    torch.manual_seed(seed)
    module = cls.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and not param.any():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            if weight_noise:
                param.add_(torch.randn(param.shape, generator=gen) * weight_noise)
    return module


def write_random_module(
    directory: Path, cls: NativeModelClass, config: dict, seed: int, weight_noise: float = 0.0
) -> None:
    """A `random_native_module` of `cls` saved to `directory` as the Diffusers class it implements (a
    builder's DiT or VAE that needs no weights of its own after the random ones)."""
    module = random_native_module(cls, config, seed, weight_noise)
    save_diffusers_model(module, directory, cls.diffusers_class_name, config)


# The tiny transformers encoders: the shape several families' builders share; each adds what is its own.


def save_text_encoder(root: Path, encoder: Any, tokenizer: Any, suffix: str = "") -> None:
    """A text encoder and its tokenizer as the pipeline folders hold them: `text_encoder{suffix}/` and
    `tokenizer{suffix}/`, written by their `save_pretrained`."""
    encoder.save_pretrained(root / f"text_encoder{suffix}")
    tokenizer.save_pretrained(root / f"tokenizer{suffix}")


def clip_text_config(tokenizer: Any, hidden_size: int, num_layers: int = 2) -> CLIPTextConfig:
    """A tiny CLIP text tower over `tokenizer` (`tokenizers.build_clip_tokenizer`), projecting to its width."""
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=hidden_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def t5_shape(vocab_size: int, d_model: int, num_layers: int) -> dict[str, Any]:
    """The keywords of a tiny gated-GELU T5 encoder stack (T5, UMT5, ByT5 configs)."""
    return {
        "vocab_size": vocab_size,
        "d_model": d_model,
        "d_kv": 8,
        "d_ff": d_model * 2,
        "num_layers": num_layers,
        "num_heads": 4,
        "feed_forward_proj": "gated-gelu",
    }


def t5_encoder_config(tokenizer: Any, d_model: int, num_layers: int = 2) -> T5Config:
    """The T5 encoder of FLUX.1 and SD3 folders over `tokenizer` (`tokenizers.build_t5_tokenizer`)."""
    return T5Config(
        **t5_shape(len(tokenizer), d_model, num_layers),
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def qwen_text_shape(
    tokenizer: Any,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_positions: int,
    mrope: bool = False,
) -> dict[str, Any]:
    """The keywords of a tiny Qwen text stack (Qwen2.5-VL's language model, Qwen3) over the byte-level Qwen
    tokenizer (`qwen_tokenizers.py`). `mrope`: Qwen2.5-VL's multimodal rotary sections (temporal, height,
    width) over half the head dim, in the released model's 16:24:24 proportions."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1000000.0}
    if mrope:
        half = hidden_size // num_heads // 2
        rope["mrope_section"] = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    ids = tokenizer.convert_tokens_to_ids
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope,
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }


def write_qwen3_text_encoder(
    root: Path, model_cls: type, hidden_size: int, num_layers: int, num_heads: int = 2, num_kv_heads: int = 1
) -> None:
    """`text_encoder/`, a tiny Qwen3 of `model_cls` (Z-Image's `Qwen3Model`, FLUX.2 [klein]'s
    `Qwen3ForCausalLM`) with tied embeddings as the released ones, and `tokenizer/`, the byte-level Qwen
    tokenizer."""
    tokenizer = build_qwen_tokenizer()
    config = Qwen3Config(
        **qwen_text_shape(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads, 40960),
        head_dim=hidden_size // num_heads,
        tie_word_embeddings=True,
    )
    save_text_encoder(root, model_cls(config).eval(), tokenizer)


def double_single_stream_dit_config(
    spec: Any, joint_attention_dim: int, out_channels: bool = True
) -> dict[str, Any]:
    """The leading keys of a FLUX-style DiT's config (double-stream blocks, then single-stream ones) from a
    tiny spec's `latent_channels`, `num_layers`, `num_single_layers`, `attention_head_dim` and
    `num_attention_heads`: patchified 2x2 latents in, as many out. The builders of that kind of DiT add
    their own keys after these; `out_channels=False` leaves out the `out_channels: None` key for a config
    that has none (the written config.json keeps its key order)."""
    config: dict[str, Any] = {"patch_size": 1, "in_channels": spec.latent_channels * 4}
    if out_channels:
        config["out_channels"] = None
    config.update(
        num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers,
        attention_head_dim=spec.attention_head_dim,
        num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=joint_attention_dim,
    )
    return config


def qwen2_5_vl_encoder(spec: Any, tokenizer: Any, **vision_config: Any) -> Qwen2_5_VLForConditionalGeneration:
    """A tiny Qwen2.5-VL text encoder (the full model with its vision tower, in eval mode) from a spec's
    `text_hidden_size`, `text_layers`, `text_heads`, `text_kv_heads`, `vision_hidden_size` and
    `vision_depth`, over the byte-level Qwen tokenizer; `vision_config` adds keys to the tower's config
    (patch and window sizes, which the families that set them write out)."""
    text = qwen_text_shape(
        tokenizer,
        spec.text_hidden_size,
        spec.text_layers,
        spec.text_heads,
        spec.text_kv_heads,
        32768,
        mrope=True,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_hidden_size * 2,
            "num_heads": 2,
            "out_hidden_size": spec.text_hidden_size,
            **vision_config,
            "fullatt_block_indexes": [spec.vision_depth - 1],
        },
        **qwen_vl_token_ids(tokenizer),
        tie_word_embeddings=False,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_vl_token_ids(tokenizer: Any) -> dict[str, int]:
    """The Qwen vision-language config keywords naming the byte-level Qwen tokenizer's image, video and
    vision-span tokens (Qwen2.5-VL's and Qwen3-VL's configs alike)."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def vision_tower_shape(
    hidden_size: int, image_size: int, patch_size: int, num_layers: int = 2
) -> dict[str, int]:
    """The keywords of a tiny ViT image encoder (CLIP, SigLIP and Pixtral vision configs): two heads."""
    return {
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": patch_size,
    }


class GemmaTextSpec(Protocol):
    """The fields of a tiny spec that shape its Gemma-2 text encoder."""

    text_hidden_size: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_sliding_window: int
    text_max_positions: int


def gemma2_text_encoder(tokenizer: GemmaTokenizer, spec: GemmaTextSpec) -> Gemma2Model:
    """A tiny `Gemma2Model` (eval mode) over `tokenizer` (`tokenizers.build_gemma_tokenizer`): layers
    alternate sliding-window and full attention, as the released gemma-2 decoders do, so a short window
    exercises both."""
    head_dim = spec.text_hidden_size // spec.text_heads
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.text_layers)]
    return Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden_size,
            intermediate_size=spec.text_hidden_size * 2,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            max_position_embeddings=spec.text_max_positions,
            sliding_window=spec.text_sliding_window,
            layer_types=layer_types,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()


def llama_text_shape(
    tokenizer: Any, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, max_positions: int
) -> dict[str, Any]:
    """The keywords of a tiny Llama text stack (a `LlamaConfig`, or a Llava's text config) over `tokenizer`,
    with its begin, end and pad tokens (None where it has no pad token)."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_positions,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def write_clip_image_processor(directory: Path, size: int) -> None:
    """A `CLIPImageProcessor` that resizes and centre-crops images to `size` pixels square, saved to
    `directory` (the image-to-video folders' `image_processor/`)."""
    CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(directory)


def wan21_vae_config(base_dim: int) -> dict[str, Any]:
    """The config of a tiny `AutoencoderKLWan` in Wan 2.1's layout (16 latent channels, 8x spatial and 4x
    temporal compression, the released per-channel latent statistics) at `base_dim` channels."""
    return {
        "base_dim": base_dim,
        "z_dim": 16,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "dropout": 0.0,
        "latents_mean": list(LATENTS_MEAN),  # the released Wan 2.1 VAE's
        "latents_std": list(LATENTS_STD),
    }
