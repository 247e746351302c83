"""LTX-2's text conditioning, as Diffusers' `_get_gemma_prompt_embeds` then `connectors`: the prompt
(stripped) is left-padded to `max_sequence_length` Gemma tokens, every hidden state of Gemma (embeddings
and each layer) is stacked on a last axis and flattened into one wide vector per token, and the text
connectors turn it into the video stream's and the audio stream's text states plus the mask the DiT
attends with (all ones when the connectors fill padding with their learnable registers).

Each prompt is encoded alone (the connectors normalise per prompt, so batching changes nothing but the
rounding) and cached with its settings."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from diffserve.families.ltx2.conditioning import LTX2Conditioning
from diffserve.models.dits.ltx2_connectors import LTX2TextConnectorsConfig
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts


class LTX2Text(NamedTuple):
    """One prompt's DiT conditioning: video and audio text states (1, L, width) and the (1, L) mask."""

    video: torch.Tensor
    audio: torch.Tensor
    mask: torch.Tensor


def register_multiple(connectors_config: LTX2TextConnectorsConfig) -> int | None:
    """The text length both connectors take: a multiple of each one's learnable registers (they tile the
    padding with them), so the least common multiple of the video and audio connectors' counts; None
    when neither has registers (any length)."""
    counts = [
        count
        for count in (
            connectors_config.video_connector_num_learnable_registers,
            connectors_config.audio_connector_num_learnable_registers,
        )
        if count
    ]
    return math.lcm(*counts) if counts else None


def stacked_hidden_states(
    text_encoder: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Gemma's hidden states of every layer, (batch, L, hidden * (layers + 1)) hidden-major, as Diffusers
    packs them (`torch.stack(hidden_states, -1).flatten(2, 3)`)."""
    outputs = text_encoder(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    return torch.stack(outputs.hidden_states, dim=-1).flatten(2, 3)


class LTX2TextEncodingStage(Stage):
    needs = ("do_cfg",)
    sets = ("prompt_embeds", "conditioning.audio_prompt_embeds", "conditioning.prompt_embeds_mask")

    def __init__(
        self, tokenizer, text_encoder: nn.Module, connectors: nn.Module, padding_side: str, scale_factor: int
    ) -> None:
        self.tokenizer = tokenizer
        # As Diffusers: Gemma pads on the left (chat-style prompts), with its EOS when it has no pad token.
        self.tokenizer.padding_side = padding_side
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.text_encoder = text_encoder
        self.connectors = connectors
        self.padding_side = padding_side
        self.scale_factor = scale_factor
        self.cache = PromptEmbeddingCache()

    @torch.inference_mode()
    def encode(self, prompt: str, max_sequence_length: int) -> LTX2Text:
        inputs = self.tokenizer(
            [prompt.strip()],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        encoder_param = next(self.text_encoder.parameters())
        ids = inputs.input_ids.to(encoder_param.device)
        mask = inputs.attention_mask.to(encoder_param.device)
        states = stacked_hidden_states(self.text_encoder, ids, mask).to(encoder_param.dtype)
        connector_param = next(self.connectors.parameters())
        video, audio, text_mask = self.connectors(
            to_module(self.connectors, states),
            mask.to(connector_param.device),
            padding_side=self.padding_side,
            scale_factor=self.scale_factor,
        )
        return LTX2Text(video, audio, text_mask)

    def forward(self, req: Req) -> Req:
        msl = req.params.max_sequence_length
        texts = self.cache.lookup(
            request_prompts(req), (msl,), lambda batch: [self.encode(prompt, msl) for prompt in batch]
        )
        n = req.batch_size
        conditioning = LTX2Conditioning.of(req)
        positive = texts[0]
        req.prompt_embeds = positive.video.repeat(n, 1, 1)
        conditioning.audio_prompt_embeds = positive.audio.repeat(n, 1, 1)
        conditioning.prompt_embeds_mask = positive.mask.repeat(n, 1)
        if req.do_cfg:
            negative = texts[1]
            req.negative_prompt_embeds = negative.video.repeat(n, 1, 1)
            conditioning.negative_audio_prompt_embeds = negative.audio.repeat(n, 1, 1)
            conditioning.negative_prompt_embeds_mask = negative.mask.repeat(n, 1)
        return req
