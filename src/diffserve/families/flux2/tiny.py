"""Builders of small random-weight FLUX.2 checkpoints in the Diffusers `Flux2Pipeline` (FLUX.2-dev) and
`Flux2KleinPipeline` (FLUX.2 [klein]) layouts.

Both have a FLUX.2 DiT and VAE (diffserve's native classes, whose state dicts carry Diffusers' names, the
VAE's `bn` statistics included) and a FlowMatchEuler scheduler with the released FLUX.2 config:

* dev: a `Mistral3ForConditionalGeneration` text encoder (tiny Mistral text stack and Pixtral vision
  tower) and, under `tokenizer/`, the `PixtralProcessor` folder the released checkpoint has: a byte-level
  BPE tokenizer with Mistral's control tokens and a Mistral-style chat template of our own
  (`[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]`, starting with BOS), plus the processor's image
  settings written as files (transformers' PixtralProcessor needs torchvision to be constructed);
* klein: a `Qwen3ForCausalLM` text encoder and the byte-level Qwen tokenizer of `qwen_tokenizers.py`
  (its chat template has Qwen3's `enable_thinking` switch); `is_distilled` in model_index.json as asked.

The text encoders have just more layers than the hidden states FLUX.2 reads (dev: 10, 20, 30; klein: 9,
18, 27), at a tiny width, and the DiT's `joint_attention_dim` is three times that width. The folders
load in diffserve and in Diffusers (give Diffusers' Flux2Pipeline the tokenizer itself as `tokenizer`
without torchvision: it only calls its `apply_chat_template`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
    Qwen3ForCausalLM,
)

from diffserve.families.flux2.config import FLUX2_SYSTEM_MESSAGE
from diffserve.models.dits.flux2 import Flux2Transformer2DModel
from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffserve.testing.qwen_tokenizers import _whole_word_merges
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    RESOLUTION_SHIFT_SCHEDULER_CONFIG,
    check_variant,
    double_single_stream_dit_config,
    finish_tiny_folder,
    random_native_module,
    save_diffusers_model,
    tiny_folder,
    vision_tower_shape,
    write_json,
    write_qwen3_text_encoder,
    write_random_module,
    write_scheduler_config,
)
from diffserve.testing.tokenizers import _bytes_to_unicode

#: Mistral's (Tekken's) control tokens in their real order: ids 0-19, so `[IMG]` is 10 as in the
#: released Mistral3 config's `image_token_index`.
MISTRAL_CONTROL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)

#: A Mistral Small 3.1 shaped chat template of our own: BOS, then each turn in its markers; content is a
#: string or a list of text / image blocks.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '[IMG]' -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)

#: The released FLUX.2-dev / klein scheduler_config.json values.
FLUX2_SCHEDULER_CONFIG = {
    **RESOLUTION_SHIFT_SCHEDULER_CONFIG,
    "invert_sigmas": False,
    "shift_terminal": None,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

PIPELINE_CLASSES = {"dev": "Flux2Pipeline", "klein": "Flux2KleinPipeline"}


@dataclass
class TinyFlux2Spec:
    """Shape of a tiny FLUX.2 checkpoint; `variant` is "dev" or "klein". Defaults give a ~0.1M-parameter
    DiT and text encoders of ~30 layers 16 wide, each a few milliseconds per prompt."""

    variant: str = "dev"
    num_layers: int = 1
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int, int] = (4, 4, 4, 4)
    timestep_guidance_channels: int = 32
    latent_channels: int = 8
    vae_block_out_channels: tuple[int, ...] = (16, 32, 32, 32)
    vae_norm_num_groups: int = 8
    text_hidden_size: int = 16
    #: dev reads layers 10, 20, 30 and klein 9, 18, 27: one more keeps every read state un-normed.
    text_layers: int | None = None
    #: klein only: model_index.json's `is_distilled` (a step-distilled checkpoint runs without CFG).
    is_distilled: bool = False
    #: N(0, weight_noise) added to every DiT weight: a random DiT is otherwise nearly blind to its text.
    dit_weight_noise: float = 0.3
    seed: int = 0

    @property
    def encoder_layers(self) -> int:
        return self.text_layers or (31 if self.variant == "dev" else 28)


def build_mistral_tokenizer(model_max_length: int = 131072) -> PreTrainedTokenizerFast:
    """Byte-level BPE after Mistral's control tokens, padding on the left, with `MISTRAL_CHAT_TEMPLATE`.

    Every byte is a token; the words of FLUX.2's system message get merges that make each one token, as
    in the real 131k vocabulary, so the system turn takes ~40 tokens and not ~180 (short
    `max_sequence_length`s would otherwise cut the prompt off)."""
    vocab = {token: i for i, token in enumerate(MISTRAL_CONTROL_TOKENS)}
    for symbol in _bytes_to_unicode():
        vocab.setdefault(symbol, len(vocab))
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = list(
        dict.fromkeys(w for w, _ in pre_tokenizer.pre_tokenize_str(FLUX2_SYSTEM_MESSAGE) if len(w) > 1)
    )
    merges = _whole_word_merges(words, vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in MISTRAL_CONTROL_TOKENS]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def write_pixtral_processor(directory: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """The released `tokenizer/` folder's layout: the tokenizer files with the chat template, and the
    PixtralProcessor's and its image processor's settings (Mistral Small 3.1's values)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    # The generic fast class (transformers 5 writes its own name for it, which 4.x does not know).
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    write_json(config_path, {**config, "tokenizer_class": "PreTrainedTokenizerFast"}, newline=True)
    processor = {
        "processor_class": "PixtralProcessor",
        "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
        "patch_size": 16,
        "spatial_merge_size": 2,
    }
    write_json(directory / "processor_config.json", processor, newline=True)
    image_processor = {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "PixtralProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": {"height": 16, "width": 16},
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": 1540},
    }
    write_json(directory / "preprocessor_config.json", image_processor, newline=True)


def _mistral3_encoder(
    spec: TinyFlux2Spec, tokenizer: PreTrainedTokenizerFast
) -> Mistral3ForConditionalGeneration:
    width = spec.text_hidden_size
    text = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=width * 2,
        num_hidden_layers=spec.encoder_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=width // 2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        sliding_window=None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = PixtralVisionConfig(**vision_tower_shape(16, image_size=64, patch_size=16, num_layers=1))
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        multimodal_projector_bias=False,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def flux2_model_index(variant: str, is_distilled: bool = False) -> dict:
    """The `model_index.json` of a Flux2Pipeline / Flux2KleinPipeline folder (the released component classes)."""
    index = {
        "_class_name": PIPELINE_CLASSES[variant],
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    if variant == "dev":
        index["text_encoder"] = ["transformers", "Mistral3ForConditionalGeneration"]
        index["tokenizer"] = ["transformers", "PixtralProcessor"]
    else:
        index["text_encoder"] = ["transformers", "Qwen3ForCausalLM"]
        index["tokenizer"] = ["transformers", "Qwen2TokenizerFast"]
        index["is_distilled"] = is_distilled
    return index


def write_flux2_vae(directory: Path, spec: TinyFlux2Spec) -> None:
    """A random `AutoencoderKLFlux2` whose `bn` statistics are not the identity (mean ~N(0, 0.5), variance
    in [0.5, 2]), so the pipelines' (de)normalisation is exercised."""
    n_levels = len(spec.vae_block_out_channels)
    config = {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * n_levels,
        "up_block_types": ["UpDecoderBlock2D"] * n_levels,
        "block_out_channels": list(spec.vae_block_out_channels),
        "decoder_block_out_channels": None,
        "layers_per_block": 1,
        "act_fn": "silu",
        "latent_channels": spec.latent_channels,
        "norm_num_groups": spec.vae_norm_num_groups,
        "sample_size": 64,
        "use_quant_conv": True,
        "use_post_quant_conv": True,
        "mid_block_add_attention": True,
        "batch_norm_eps": 1e-4,
        "batch_norm_momentum": 0.1,
        "patch_size": [2, 2],
        "force_upcast": True,
    }
    vae = random_native_module(AutoencoderKLFlux2, config, spec.seed + 20)
    gen = torch.Generator().manual_seed(spec.seed + 21)
    channels = vae.bn.num_features
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(channels, generator=gen) * 0.5)
        vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(channels, generator=gen))
    save_diffusers_model(vae, directory, "AutoencoderKLFlux2", config)


def build_tiny_flux2(out_dir: str | Path, spec: TinyFlux2Spec | None = None) -> Path:
    """Write a random-weight FLUX.2 folder (`spec.variant`: "dev" or "klein") to `out_dir`; return its path."""
    spec = spec or TinyFlux2Spec()
    check_variant("FLUX.2", spec.variant, PIPELINE_CLASSES)
    root = tiny_folder(out_dir, spec.seed)

    if spec.variant == "dev":
        tokenizer = build_mistral_tokenizer()
        _mistral3_encoder(spec, tokenizer).save_pretrained(root / "text_encoder")
        write_pixtral_processor(root / "tokenizer", tokenizer)
    else:
        write_qwen3_text_encoder(root, Qwen3ForCausalLM, spec.text_hidden_size, spec.encoder_layers)

    dit_config = {
        **double_single_stream_dit_config(spec, 3 * spec.text_hidden_size),
        "timestep_guidance_channels": spec.timestep_guidance_channels,
        "mlp_ratio": 3.0,
        "axes_dims_rope": list(spec.axes_dims_rope),
        "rope_theta": 2000,
        "eps": 1e-6,
        "guidance_embeds": spec.variant == "dev",
    }
    write_random_module(
        root / "transformer", Flux2Transformer2DModel, dit_config, spec.seed + 10, spec.dit_weight_noise
    )
    write_flux2_vae(root / "vae", spec)
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", FLUX2_SCHEDULER_CONFIG)
    return finish_tiny_folder(root, flux2_model_index(spec.variant, spec.is_distilled), spec)
