"""Components that several tiny-checkpoint builders write alike, beyond `tiny_writing`'s: a tiny Gemma-2
text tower, the keywords of a tiny Llama text stack, the CLIP image processor of the image-to-video
folders and the tiny Wan 2.1 VAE config (Wan's own folders and SANA-Video's ship that VAE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from transformers import CLIPImageProcessor, Gemma2Config, Gemma2Model, GemmaTokenizer

from diffserve.models.vaes.causal3d_blocks import LATENTS_MEAN, LATENTS_STD


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
