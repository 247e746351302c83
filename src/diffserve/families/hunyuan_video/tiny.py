"""Builder of small random-weight HunyuanVideo checkpoints in the Diffusers `HunyuanVideoPipeline` layout.

A Llama text encoder (`LlamaModel`, 3 layers: the pipeline reads the third-to-last hidden states) with an
in-memory Llama-3-style tokenizer (`llama_template_tokenizer`), a CLIP text encoder with its tokenizer, the
native DiT (`HunyuanVideoTransformer3DModel`, state dict in Diffusers' names, every weight noised so the
text matters, guidance embedding on as released), the native VAE (the released 4 levels at tiny widths,
encoder weights included) and the released flow-matching scheduler config (static shift 7).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken
from transformers import CLIPTextModel, LlamaConfig, LlamaModel, LlamaTokenizer

from diffserve.families.hunyuan_video.config import PROMPT_TEMPLATE
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel
from diffserve.models.vaes.autoencoder_kl_hunyuan_video import AutoencoderKLHunyuanVideo
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    clip_text_config,
    finish_tiny_folder,
    llama_text_shape,
    save_text_encoder,
    tiny_folder,
    write_random_module,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import build_clip_tokenizer

#: The released HunyuanVideo folder's scheduler config.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 7.0, "use_dynamic_shifting": False}
#: Llama-3's markers of chat turns, single tokens as in the real vocabulary.
HEADER_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def llama_template_tokenizer(
    template: str = PROMPT_TEMPLATE,
    special_tokens: tuple[str, ...] = HEADER_TOKENS,
    words: tuple[str, ...] = (),
    pad_token: str = "<|end_of_text|>",
) -> LlamaTokenizer:
    """A Llama tokenizer (byte fallback, Metaspace) whose words of the family's prompt `template` are single
    tokens, as in the real vocabulary, so the template's system part stays about as long as the pipeline's
    fixed crop (95 tokens) assumes; Llama-3's begin / end-of-text tokens, `pad_token` padding on the right.
    `special_tokens` are added whole; `words` are added as plain tokens (whole wherever they occur), for
    template pieces whose position the pipeline fixes."""
    vocab = {token: i for i, token in enumerate(("<unk>", "<|begin_of_text|>", "<|end_of_text|>"))}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in ["▁", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(char, len(vocab))
    merges: list[tuple[str, str]] = []
    spaced = re.findall(r"(?<= )[A-Za-z]+", template)
    unspaced = re.findall(r"(?<![ A-Za-z])[A-Za-z]+", template)
    # Space-led words first (their pairs start with "▁"), then the words that follow a newline or marker.
    for word, piece in [(w, "▁") for w in dict.fromkeys(spaced)] + [(w, "") for w in dict.fromkeys(unspaced)]:
        for char in word:
            if piece and piece + char not in vocab:
                merges.append((piece, char))
                vocab[piece + char] = len(vocab)
            piece += char
    tokenizer = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token=pad_token if pad_token in vocab else None,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="right",
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in special_tokens]}
    )
    if pad_token not in vocab:
        tokenizer.pad_token = pad_token
    if words:
        tokenizer.add_tokens([AddedToken(w, normalized=False) for w in words])
    return tokenizer


@dataclass
class TinyHunyuanVideoSpec:
    """Shape of a tiny HunyuanVideo checkpoint."""

    num_layers: int = 1
    num_single_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    text_dim: int = 32
    text_layers: int = 3
    pooled_dim: int = 16
    latent_channels: int = 4
    guidance_embeds: bool = True
    dit_weight_noise: float = 0.2
    seed: int = 0
    #: Keys over the DiT's, the VAE's and the scheduler's tiny configs (a checkpoint's other values);
    #: a VAE `block_out_channels` brings as many down / up blocks unless the block types are given too.
    extra_dit_config: dict = field(default_factory=dict)
    extra_vae_config: dict = field(default_factory=dict)
    extra_scheduler_config: dict = field(default_factory=dict)


def tiny_dit_config(spec: TinyHunyuanVideoSpec) -> dict:
    return {
        "in_channels": spec.latent_channels,
        "out_channels": spec.latent_channels,
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "num_layers": spec.num_layers,
        "num_single_layers": spec.num_single_layers,
        "num_refiner_layers": 1,
        "mlp_ratio": 4.0,
        "patch_size": 2,
        "patch_size_t": 1,
        "qk_norm": "rms_norm",
        "guidance_embeds": spec.guidance_embeds,
        "text_embed_dim": spec.text_dim,
        "pooled_projection_dim": spec.pooled_dim,
        "rope_theta": 256.0,
        "rope_axes_dim": (4, 6, 6),
        "image_condition_type": None,
        **spec.extra_dit_config,
    }


def tiny_vae_config(spec: TinyHunyuanVideoSpec) -> dict:
    config = {
        "latent_channels": spec.latent_channels,
        "block_out_channels": (8, 16, 16, 16),
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "scaling_factor": 0.476986,
        **spec.extra_vae_config,
    }
    if "block_out_channels" in spec.extra_vae_config:
        levels = len(config["block_out_channels"])
        config.setdefault("down_block_types", ("HunyuanVideoDownBlock3D",) * levels)
        config.setdefault("up_block_types", ("HunyuanVideoUpBlock3D",) * levels)
    return config


def _llama(tokenizer: LlamaTokenizer, spec: TinyHunyuanVideoSpec) -> LlamaModel:
    return LlamaModel(LlamaConfig(**llama_text_shape(tokenizer, spec.text_dim, spec.text_layers, 2, 2, 512)))


def hunyuan_video_model_index() -> dict:
    """The `model_index.json` of a HunyuanVideo folder."""
    return {
        "_class_name": "HunyuanVideoPipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "LlamaModel"],
        "text_encoder_2": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "LlamaTokenizerFast"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "transformer": ["diffusers", "HunyuanVideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo"],
    }


def write_clip_dit_vae_scheduler(root: Path, spec: TinyHunyuanVideoSpec, dit_config: dict) -> None:
    """The components after the Llama encoder (built first: the folder's random weights follow that order):
    the CLIP text encoder with its tokenizer, the DiT from `dit_config`, the VAE and the scheduler."""
    clip_tokenizer = build_clip_tokenizer(77)
    save_text_encoder(
        root, CLIPTextModel(clip_text_config(clip_tokenizer, spec.pooled_dim)), clip_tokenizer, suffix="_2"
    )
    write_random_module(
        root / "transformer",
        HunyuanVideoTransformer3DModel,
        dit_config,
        spec.seed + 10,
        spec.dit_weight_noise,
    )
    write_random_module(root / "vae", AutoencoderKLHunyuanVideo, tiny_vae_config(spec), spec.seed + 20, 0.02)
    write_scheduler_config(
        root, "FlowMatchEulerDiscreteScheduler", {**SCHEDULER_CONFIG, **spec.extra_scheduler_config}
    )


def build_tiny_hunyuan_video(out_dir: str | Path, spec: TinyHunyuanVideoSpec | None = None) -> Path:
    """Write a random-weight HunyuanVideo folder to `out_dir` and return its path."""
    spec = spec or TinyHunyuanVideoSpec()
    root = tiny_folder(out_dir, spec.seed)
    tokenizer = llama_template_tokenizer()
    save_text_encoder(root, _llama(tokenizer, spec), tokenizer)
    write_clip_dit_vae_scheduler(root, spec, tiny_dit_config(spec))
    return finish_tiny_folder(root, hunyuan_video_model_index(), spec)
