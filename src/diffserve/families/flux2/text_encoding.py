"""FLUX.2's prompt encoding: the prompt in its text encoder's chat format, padded to `max_sequence_length`,
read at three intermediate layers whose states are concatenated per token (B, L, 3 * hidden), as
Diffusers' Flux2Pipeline (Mistral Small 3.1 with BFL's system message) and Flux2KleinPipeline (Qwen3, a
user turn with thinking off) do. Padding tokens are kept: the DiT attends to all L text tokens.

Only the encoder's decoder stack runs (`get_decoder()`): its hidden states are the ones Diffusers reads
from the full model, without the LM head's logits over the whole vocabulary (Mistral: 131k x 5120 per
token) that Diffusers computes and drops.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from diffserve.families.flux2.conditioning import Flux2Conditioning
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts, set_sequence_embeds

#: Pixtral's image placeholder. Diffusers strips it from prompts: the processor would count it as an
#: image slot; as text it means nothing to the model.
IMAGE_PLACEHOLDER = "[IMG]"


def flux2_text_ids(length: int, device: torch.device) -> torch.Tensor:
    """(length, 4) RoPE ids (T, H, W, L) = (0, 0, 0, l) of the text tokens (Diffusers' `_prepare_text_ids`)."""
    ids = torch.zeros(length, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def stack_layers(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """Per token, the states of `layers` side by side: (B, L, len(layers) * hidden)."""
    return torch.cat([hidden_states[k] for k in layers], dim=-1)


class Flux2TextEncodingStage(Stage):
    """FLUX.2-dev: each prompt as a [system, user] chat (content blocks, no generation prompt), tokenized
    as Diffusers' PixtralProcessor does (special tokens added unless the chat starts with BOS)."""

    needs = ("do_cfg",)
    sets = ("prompt_embeds", "conditioning.text_ids")

    def __init__(
        self,
        tokenizer,
        text_encoder: nn.Module,
        layers: tuple[int, ...],
        system_message: str | None,
        output_dtype: torch.dtype,
    ) -> None:
        """`tokenizer`: a transformers tokenizer with the model's chat template. `layers`: hidden-state
        indices (0 is the embedding output); the encoder must have at least max(layers) layers."""
        num_layers = text_encoder.get_decoder().config.num_hidden_layers
        if max(layers) > num_layers:
            raise ValueError(f"text encoder has {num_layers} layers; FLUX.2 reads hidden states {layers}")
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.layers = tuple(layers)
        self.system_message = system_message
        self.output_dtype = output_dtype
        self.cache = PromptEmbeddingCache()

    @property
    def state_width(self) -> int:
        """Channels of the states per token: the encoder's hidden size once per layer read (the DiT's
        `joint_attention_dim`)."""
        return len(self.layers) * self.text_encoder.get_decoder().config.hidden_size

    def chat_texts(self, prompts: list[str]) -> list[str]:
        """The prompts rendered in the encoder's chat template."""
        conversations = [
            [
                {"role": "system", "content": [{"type": "text", "text": self.system_message}]},
                {"role": "user", "content": [{"type": "text", "text": p.replace(IMAGE_PLACEHOLDER, "")}]},
            ]
            for p in prompts
        ]
        return self.tokenizer.apply_chat_template(conversations, add_generation_prompt=False, tokenize=False)

    def add_special_tokens(self, text: str) -> bool:
        """A processor's `apply_chat_template` adds the tokenizer's special tokens unless the rendered chat
        already starts with BOS (Mistral's template writes it)."""
        bos = self.tokenizer.bos_token
        return not (bos is not None and text.startswith(bos))

    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> list[torch.Tensor]:
        """One (1, max_sequence_length, len(layers) * hidden) tensor per prompt."""
        texts = self.chat_texts(prompts)
        rows = [
            self.tokenizer(
                text,
                padding="max_length",
                truncation=True,
                max_length=max_sequence_length,
                add_special_tokens=self.add_special_tokens(text),
                return_tensors="pt",
            )
            for text in texts
        ]
        device = next(self.text_encoder.parameters()).device
        input_ids = torch.cat([r["input_ids"] for r in rows]).to(device)
        attention_mask = torch.cat([r["attention_mask"] for r in rows]).to(device)
        output = self.text_encoder.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        states = stack_layers(output.hidden_states, self.layers).to(self.output_dtype)
        return [states[i : i + 1].clone() for i in range(len(prompts))]

    def forward(self, req: Req) -> Req:
        length = req.params.max_sequence_length
        embeds = self.cache.lookup(
            request_prompts(req), (length,), functools.partial(self.encode, max_sequence_length=length)
        )
        set_sequence_embeds(req, embeds)
        Flux2Conditioning.of(req).text_ids = flux2_text_ids(embeds[0].shape[1], req.prompt_embeds.device)
        return req


class Flux2KleinTextEncodingStage(Flux2TextEncodingStage):
    """FLUX.2 [klein]: each prompt as one user turn (string content) with the generation prompt and
    thinking off, tokenized with the tokenizer's defaults (Qwen adds no special tokens)."""

    def chat_texts(self, prompts: list[str]) -> list[str]:
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            for p in prompts
        ]

    def add_special_tokens(self, text: str) -> bool:
        return True
