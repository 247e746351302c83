"""What the families' text-encoding stages (`<family>_text_encoding.py`) share: tokenizing, the texts a
request encodes, setting its embeddings through the prompt cache, and the CLIP context length."""

from __future__ import annotations

import logging

import torch
from torch import nn

from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache

logger = logging.getLogger("diffserve.stages")


class CachedTextEncodingStage(Stage):
    """A text-encoding stage over one tokenizer and one text encoder, whose prompts' embeddings go through
    a `PromptEmbeddingCache` and come out in `output_dtype`. The families' stages of that kind share this
    constructor and write their own `encode` and `forward` (the tokenizing and what they set differ)."""

    needs = ("do_cfg",)
    sets = ("prompt_embeds",)

    def __init__(self, tokenizer, text_encoder: nn.Module, output_dtype: torch.dtype) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.output_dtype = output_dtype
        self.cache = PromptEmbeddingCache()


class SequenceTextEncodingStage(CachedTextEncodingStage):
    """A cached text-encoding stage whose `encode(prompts, max_sequence_length)` gives one
    (len(prompts), max_sequence_length, dim) tensor: each prompt's row is cached, and the request's
    sequence embeddings are set from them (no mask, no pooled text)."""

    def encode(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, req: Req) -> Req:
        msl = req.params.max_sequence_length
        embeds = self.cache.lookup(
            request_prompts(req),
            (msl,),
            lambda batch: [row.clone() for row in self.encode(batch, msl).split(1)],
        )
        set_sequence_embeds(req, embeds)
        return req


def tokenize(tokenizer, prompts: list[str], max_length: int, device: torch.device) -> torch.Tensor:
    """`prompts`' token ids padded and truncated to `max_length`, with a warning when one was truncated.
    The check tokenizes to `max_length + 1` (truncated too): untruncated, a long prompt would make
    transformers warn of "indexing errors" the truncated ids never cause."""
    ids = tokenizer(
        prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    longer = tokenizer(prompts, max_length=max_length + 1, truncation=True).input_ids
    if any(len(row) > max_length for row in longer):
        logger.warning("prompt truncated to %d tokens for %s", max_length, type(tokenizer).__name__)
    return ids.to(device)


def request_prompts(req: Req) -> list[str]:
    """The texts a request encodes in one batch: its prompt, then its negative prompt when it runs CFG."""
    p = req.params
    return [p.prompt] + ([p.negative_prompt] if req.do_cfg else [])


def set_sequence_embeds(req: Req, embeds: list[torch.Tensor]) -> None:
    """Set the request's sequence embeddings from one (1, L, D) tensor per `request_prompts(req)` text."""
    n = req.params.num_outputs_per_prompt
    req.prompt_embeds = embeds[0].repeat(n, 1, 1)
    if req.do_cfg:
        req.negative_prompt_embeds = embeds[1].repeat(n, 1, 1)


def encode_request_prompts(req: Req, encode, cache: PromptEmbeddingCache | None = None) -> None:
    """Set the request's embeddings from `encode(prompts, max_sequence_length) -> (sequence, pooled)`."""
    p = req.params
    n = p.num_outputs_per_prompt
    prompts = request_prompts(req)

    def rows(batch: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sequence, pooled = encode(batch, p.max_sequence_length)
        return [(sequence[i : i + 1].clone(), pooled[i : i + 1].clone()) for i in range(len(batch))]

    values = cache.lookup(prompts, (p.max_sequence_length,), rows) if cache is not None else rows(prompts)
    set_sequence_embeds(req, [sequence for sequence, _ in values])
    req.pooled_prompt_embeds = values[0][1].repeat(n, 1)
    if req.do_cfg:
        req.negative_pooled_prompt_embeds = values[1][1].repeat(n, 1)


def clip_context_length(tokenizer, default: int = 77) -> int:
    """The CLIP tokenizer's context length; tokenizers without a recorded limit report a huge sentinel."""
    length = getattr(tokenizer, "model_max_length", None) or default
    return default if length > 10_000 else int(length)
