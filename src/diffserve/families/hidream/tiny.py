"""Builder of small random-weight HiDream-I1 checkpoints in the Diffusers `HiDreamImagePipeline` layout.

Two CLIP encoders with projection (248 positions, as HiDream's long-context CLIPs), a T5 encoder, a
`LlamaForCausalLM` with a byte-level `PreTrainedTokenizerFast` (begin-of-text prepended, no pad token, as
Llama 3.1's), the native DiT (every weight noised so the text matters), a one-level `AutoencoderKL` (scale
factor 1: Diffusers' area rule makes every image 128 x 128 pixels then) and the flow-matching Euler
scheduler of HiDream-I1-Dev/Fast (static shift; `scheduler="unipc"` writes HiDream-I1-Full's UniPC instead).
The DiT's 8 x 8 patches keep the 128 x 128 latents at 256 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    CLIPTextModelWithProjection,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5EncoderModel,
)

from diffserve.models.dits.hidream_image import HiDreamImageTransformer2DModel
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    autoencoder_kl_config,
    check_variant,
    clip_text_config,
    finish_tiny_folder,
    llama_text_shape,
    save_diffusers_model,
    save_text_encoder,
    t5_encoder_config,
    tiny_folder,
    write_random_module,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import _bytes_to_unicode, build_clip_tokenizer, build_t5_tokenizer

LLAMA_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")

#: The released schedulers: HiDream-I1-Dev's flow-matching Euler (Fast's has shift 3.0) and Full's UniPC.
SCHEDULERS = {
    "euler": (
        "FlowMatchEulerDiscreteScheduler",
        {"num_train_timesteps": 1000, "shift": 6.0, "use_dynamic_shifting": False},
    ),
    "unipc": (
        "UniPCMultistepScheduler",
        {
            "num_train_timesteps": 1000,
            "flow_shift": 3.0,
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "solver_order": 2,
        },
    ),
}


@dataclass
class TinyHiDreamSpec:
    """Shape of a tiny HiDream-I1 checkpoint."""

    num_layers: int = 1
    num_single_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    patch_size: int = 8
    latent_channels: int = 16
    clip_hidden_size: int = 16
    t5_hidden_size: int = 24
    llama_hidden_size: int = 32
    llama_layers: int = 3
    dit_weight_noise: float = 0.1
    scheduler: str = "euler"
    seed: int = 0
    #: The VAE's levels (their count sets its scale factor: 2 ** (levels - 1); one level keeps images small).
    vae_block_out_channels: tuple[int, ...] = (16,)
    #: The T5 and Llama tokenizers' `model_max_length` (Diffusers caps `max_sequence_length` at each).
    t5_max_length: int = 512
    llama_max_length: int = 131072
    #: Diffusers config keys that override (or add to) the builder's, per component: other checkpoints'
    #: configs (block counts, experts, RoPE axes, VAE factors, scheduler shifts ...).
    extra_transformer_config: dict = field(default_factory=dict)
    extra_vae_config: dict = field(default_factory=dict)
    extra_scheduler_config: dict = field(default_factory=dict)


def build_llama_tokenizer(model_max_length: int = 131072) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte a token, no merges) with Llama 3's begin/end-of-text tokens, the first
    prepended to every text; no pad token (the pipeline pads with the end-of-text token)."""
    vocab = {token: i for i, token in enumerate(LLAMA_SPECIAL_TOKENS)}
    for symbol in _bytes_to_unicode():
        vocab.setdefault(symbol, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIAL_TOKENS])
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 0)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=True,
    )


def _dit_config(spec: TinyHiDreamSpec) -> dict:
    blocks = spec.num_layers + spec.num_single_layers
    return {
        "patch_size": spec.patch_size,
        "in_channels": spec.latent_channels,
        "out_channels": spec.latent_channels,
        "num_layers": spec.num_layers,
        "num_single_layers": spec.num_single_layers,
        "attention_head_dim": spec.attention_head_dim,
        "num_attention_heads": spec.num_attention_heads,
        "caption_channels": [spec.t5_hidden_size, spec.llama_hidden_size],
        "text_emb_dim": 2 * spec.clip_hidden_size + 8,
        "num_routed_experts": 4,
        "num_activated_experts": 2,
        "axes_dims_rope": list(spec.axes_dims_rope),
        "max_resolution": [128, 128],
        "llama_layers": [(i + 1) % spec.llama_layers for i in range(blocks)],
        "force_inference_output": False,
        **spec.extra_transformer_config,
    }


def hidream_model_index(spec: TinyHiDreamSpec) -> dict:
    """The `model_index.json` of a HiDream-I1 folder."""
    return {
        "_class_name": "HiDreamImagePipeline",
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", SCHEDULERS[spec.scheduler][0]],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "text_encoder_4": ["transformers", "LlamaForCausalLM"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": ["transformers", "T5Tokenizer"],
        "tokenizer_4": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "HiDreamImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def build_tiny_hidream(out_dir: str | Path, spec: TinyHiDreamSpec | None = None) -> Path:
    """Write a random-weight HiDream-I1 folder to `out_dir` and return its path."""
    spec = spec or TinyHiDreamSpec()
    check_variant("hidream-i1", spec.scheduler, SCHEDULERS)
    root = tiny_folder(out_dir, spec.seed)
    clip_tokenizer = build_clip_tokenizer()
    for i, suffix in enumerate(("", "_2")):  # CLIP-L, then a CLIP-G stand-in 8 wider
        config = clip_text_config(clip_tokenizer, spec.clip_hidden_size + 8 * i)
        config.max_position_embeddings = 248
        save_text_encoder(root, CLIPTextModelWithProjection(config), clip_tokenizer, suffix)
    t5_tokenizer = build_t5_tokenizer(spec.t5_max_length)
    t5 = T5EncoderModel(t5_encoder_config(t5_tokenizer, spec.t5_hidden_size))
    save_text_encoder(root, t5, t5_tokenizer, "_3")
    llama_tokenizer = build_llama_tokenizer(spec.llama_max_length)
    llama_shape = llama_text_shape(llama_tokenizer, spec.llama_hidden_size, spec.llama_layers, 4, 2, 512)
    llama_config = LlamaConfig(**llama_shape, tie_word_embeddings=False)
    save_text_encoder(root, LlamaForCausalLM(llama_config), llama_tokenizer, "_4")
    dit_config = _dit_config(spec)
    write_random_module(
        root / "transformer",
        HiDreamImageTransformer2DModel,
        dit_config,
        spec.seed + 10,
        spec.dit_weight_noise,
    )
    vae_config = {
        **autoencoder_kl_config(
            spec.vae_block_out_channels, spec.latent_channels, 8, scaling_factor=0.3611, shift_factor=0.1159
        ),
        **spec.extra_vae_config,
    }
    save_diffusers_model(AutoencoderKL.from_config(vae_config), root / "vae", "AutoencoderKL", vae_config)
    class_name, scheduler_config = SCHEDULERS[spec.scheduler]
    write_scheduler_config(root, class_name, {**scheduler_config, **spec.extra_scheduler_config})
    return finish_tiny_folder(root, hidream_model_index(spec), spec)
