"""The stages only LongCat-Image uses: its prompt encoding and its latents' position ids.

Prompt encoding, as Diffusers' `LongCatImagePipeline` does it: the prompt is cut into quoted and unquoted
spans (`quoted_spans`); unquoted spans are tokenized as they are, quoted ones (with their quote marks) one
character at a time, so that text to be rendered in the image reaches the encoder letter by letter. The
tokens are truncated or padded to `tokenizer_max_length`, put between the chat template's prefix and suffix
tokens, and run through Qwen2.5-VL's language model (no LM head); the last layer's states of the
`tokenizer_max_length` middle positions, padding included, condition the DiT.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from diffserve.families.longcat_image.conditioning import LongCatImageConditioning
from diffserve.request import LatentSize, Req
from diffserve.stages.base import Stage
from diffserve.stages.latent_preparation import LatentPreparationStage, initial_noise, pack_latents
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts, set_sequence_embeds

logger = logging.getLogger("diffserve.stages")

#: (opening, closing) quote marks whose spans are tokenized character by character.
QUOTE_PAIRS: tuple[tuple[str, str], ...] = (
    ("'", "'"),
    ('"', '"'),
    ("\u2018", "\u2019"),
    ("\u201c", "\u201d"),
)
#: A word with an apostrophe inside ("don't"): not a quote.
_APOSTROPHE_WORD = re.compile(r"[a-zA-Z]+'[a-zA-Z]+")


def _quoted_span_pattern(pairs: tuple[tuple[str, str], ...]) -> str:
    """One alternative per pair: the opening mark, the shortest run without either mark, the closing mark."""
    spans = []
    for opening, closing in pairs:
        inside = "[^" + re.escape(opening + closing) + "]*?"
        spans.append(re.escape(opening) + inside + re.escape(closing))
    return "|".join(spans)


_QUOTED_SPAN = _quoted_span_pattern(QUOTE_PAIRS)


def quoted_spans(prompt: str) -> list[tuple[str, bool]]:
    """The prompt as consecutive non-empty (text, quoted) spans, quoted spans keeping their marks.

    Apostrophes inside words are hidden behind placeholders while the quotes are found, so "don't" opens
    no quote. A span is quoted when it starts with a quoted span once its words are back (Diffusers' rule:
    an unquoted span that starts with a mark closed by a restored apostrophe counts as quoted too).
    """
    words = list(dict.fromkeys(_APOSTROPHE_WORD.findall(prompt)))
    # Placeholders of ASCII letters only (no quote mark, and no apostrophe word of their own), distinct and
    # none a part of another, so putting the words back is exact whatever their order.
    placeholders = [f"LONGCATWORD{chr(65 + i // 26)}{chr(65 + i % 26)}X" for i in range(len(words))]
    for word, placeholder in zip(words, placeholders, strict=True):
        prompt = prompt.replace(word, placeholder)
    spans = []
    for part in re.split(f"({_QUOTED_SPAN})", prompt):
        for word, placeholder in zip(words, placeholders, strict=True):
            part = part.replace(placeholder, word)
        if part:
            spans.append((part, re.match(_QUOTED_SPAN, part) is not None))
    return spans


def prompt_token_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids without special tokens: unquoted spans whole, quoted spans per character."""
    ids: list[int] = []
    for text, quoted in quoted_spans(prompt):
        for piece in text if quoted else [text]:
            ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return ids


def text_position_ids(length: int, device: torch.device) -> torch.Tensor:
    """(length, 3) float32 ids of the text tokens: modality 0, then the token's index on both other axes."""
    index = torch.arange(length, dtype=torch.float32)
    first = torch.full_like(index, float(TEXT_MODALITY))
    return torch.stack([first, index, index], dim=-1).to(device)


#: The first axis of the position ids: which stream a token is.
TEXT_MODALITY, IMAGE_MODALITY, REFERENCE_MODALITY = 0, 1, 2


def image_position_ids(
    grid_height: int, grid_width: int, start: int, device: torch.device, modality: int = IMAGE_MODALITY
) -> torch.Tensor:
    """(h*w, 3) float32 ids of packed image tokens: `modality` (1: the image being made, 2: an edit's input
    image), then row and column, both counted from `start` (the text length)."""
    rows = torch.arange(grid_height, dtype=torch.float32).repeat_interleave(grid_width)
    cols = torch.arange(grid_width, dtype=torch.float32).repeat(grid_height)
    first = torch.full_like(rows, float(modality))
    return torch.stack([first, rows + start, cols + start], dim=-1).to(device)


class LongCatTextEncodingStage(Stage):
    """Each of the request's texts as (`tokenizer_max_length`, hidden) Qwen2.5-VL states, cached per text."""

    needs = ("do_cfg",)
    sets = ("prompt_embeds", "conditioning.text_ids")

    def __init__(
        self, tokenizer, text_encoder: nn.Module, prefix: str, suffix: str, max_length: int, output_dtype
    ) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        self.suffix_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
        self.max_length = max_length
        self.output_dtype = output_dtype
        self.cache = PromptEmbeddingCache()

    def token_ids(
        self, prompts: list[str], prefix_ids: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask), (len(prompts), prefix + max_length + suffix): each prompt's tokens
        truncated or padded (the tokenizer's pad token and side) to `max_length`, between the prefix
        (`prefix_ids`, default the template's) and the suffix."""
        prefix_ids = self.prefix_ids if prefix_ids is None else prefix_ids
        rows = []
        for prompt in prompts:
            ids = prompt_token_ids(self.tokenizer, prompt)
            if len(ids) > self.max_length:
                logger.warning("LongCat-Image prompt of %d tokens truncated to %d", len(ids), self.max_length)
            rows.append(ids[: self.max_length])
        padded = self.tokenizer.pad(
            {"input_ids": rows},
            max_length=self.max_length,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = padded["input_ids"], padded["attention_mask"]
        batch = len(prompts)

        def around(middle: torch.Tensor, prefix: list[int], suffix: list[int]) -> torch.Tensor:
            before = torch.tensor(prefix, dtype=middle.dtype).expand(batch, -1)
            after = torch.tensor(suffix, dtype=middle.dtype).expand(batch, -1)
            return torch.cat([before, middle, after], dim=1)

        ones_before, ones_after = [1] * len(prefix_ids), [1] * len(self.suffix_ids)
        return around(ids, prefix_ids, self.suffix_ids), around(mask, ones_before, ones_after)

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """One (max_length, hidden) tensor per prompt."""
        ids, mask = self.token_ids(prompts)
        device = next(self.text_encoder.parameters()).device
        states = self.text_encoder.model(
            input_ids=ids.to(device), attention_mask=mask.to(device)
        ).last_hidden_state
        start = len(self.prefix_ids)
        middle = states[:, start : start + self.max_length].to(self.output_dtype)
        return list(middle.unbind(0))

    def forward(self, req: Req) -> Req:
        embeds = self.cache.lookup(request_prompts(req), (), self.encode)
        set_sequence_embeds(req, [e[None] for e in embeds])
        LongCatImageConditioning.of(req).text_ids = text_position_ids(
            req.prompt_embeds.shape[1], req.prompt_embeds.device
        )
        return req


class LongCatLatentPreparationStage(LatentPreparationStage):
    """Initial noise packed into 2x2 latent patches, with the packed grid's position ids after the text's.

    The noise is drawn in `noise_dtype` and then cast to the latents' dtype (Diffusers' text-to-image
    pipeline draws float32, its edit pipeline the model's dtype: they differ in bf16)."""

    needs = ("generator", "prompt_embeds")
    sets = ("latents", "latent_size", "conditioning.image_ids")

    def __init__(self, *args, noise_dtype: torch.dtype, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.noise_dtype = noise_dtype

    def forward(self, req: Req) -> Req:
        p = req.params
        multiple = self.vae_scale_factor * 2
        height, width = 2 * (p.height // multiple), 2 * (p.width // multiple)
        noise = initial_noise(
            req, (p.num_outputs_per_prompt, self.latent_channels, height, width), self.noise_dtype
        )
        req.latents = pack_latents(noise).to(device=self.device, dtype=self.dtype)
        req.latent_size = LatentSize(height, width)
        text_length = req.prompt_embeds.shape[1]
        ids = image_position_ids(height // 2, width // 2, text_length, self.device)
        LongCatImageConditioning.of(req).image_ids = torch.cat([ids, *self.reference_ids(req, text_length)])
        return req

    def reference_ids(self, req: Req, text_length: int) -> list[torch.Tensor]:
        """The position ids of tokens appended after the noisy ones (an edit's input image): none here."""
        return []
