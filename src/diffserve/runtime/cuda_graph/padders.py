"""Prompt padders: how a DiT's call is padded to a captured (batch bucket, token bucket) shape without
changing what the real rows compute (SGLang's per-model padders, `model_padders/`).

A padder knows one DiT's call: which arguments carry rows of the batch, which carry text tokens, what the
output looks like. `pad` makes the bucket-shaped call and `unpad` cuts the output back to the real rows.
Three contracts cover the DiTs so far:

- **masked text** (Qwen-Image, `QwenImagePadder`): the text states are zero-padded on the right to the
  token bucket and the key mask marks the added tokens (a mask is made, all true over the real tokens,
  when the eager call had none: masks stay on at batch 1, or a B=1 replay would attend the padding). The
  text RoPE and the text length follow the padded length (the DiT builds them from it; right padding
  moves no real token). Attention over the padded joint sequence is not bit-identical to the unpadded
  one (softmax sums over a different length), so the added span travels as replay-local metadata
  (`AttentionSpan`) and every attention call is a break point of the graph that runs on the real tokens
  only (`runtime/cuda_graph/runner.py`): padded = eager, bit for bit.
- **native length** (Z-Image, `NativeLengthPadder`): extra caption tokens would change what the model
  computes (its in-sample pad tokens are real, attended tokens), so the prompt keeps its own length; the
  DiT already rounds it to a multiple of 32, which is what the capture key holds.
- **fixed length** (FLUX.1: T5 at its `max_sequence_length`, `FixedLengthPadder`): nothing to pad but
  the batch.

Batch padding is the same for all: the last real row is repeated up to the batch bucket (rows never mix,
so the copies change nothing of the real rows) and the output keeps the real rows.

A family opts in by naming its padder in its record (`ModelFamily.prompt_padder`); the registry gathers
them by DiT class (`diffserve.registry.PROMPT_PADDERS`) and hands that table to the runtime, which names
no family. A DiT without one cannot be captured: `--enable-cuda-graph` is refused for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten

#: A DiT call as keyword arguments (the runner binds positional ones to their names).
Call = dict[str, Any]


@dataclass(frozen=True)
class AttentionSpan:
    """Tokens a padder inserted into the joint attention sequence: positions [start, stop) of every
    attention call whose key length is `joint_length`. The runner's break points drop them (queries,
    keys, values and mask) and attend over the rest, as the eager call did; `mask_made` says the eager
    call had no mask, so none is passed once the span is gone."""

    start: int
    stop: int
    joint_length: int
    mask_made: bool


@dataclass(frozen=True)
class PaddedCall:
    """A call padded to its buckets, and what the runner needs to replay it and cut its output."""

    call: Call
    real_batch: int
    batch_bucket: int
    text_length: int | None  # the eager call's text tokens (None: fixed or native length)
    token_bucket: int | None
    span: AttentionSpan | None = None
    #: Hashable values the capture key adds to the padded call's shapes (see `PromptPadder.signature`).
    extra: tuple[Any, ...] = field(default=())


class PromptPadder(Protocol):
    """One DiT's padding contract (see the module docstring)."""

    #: Shown in logs: "masked text", "native length", "fixed length".
    contract: str
    #: Whether attention calls must be break points (the span differs between replays of one graph).
    breaks_at_attention: bool

    def batch_size(self, call: Call) -> int:
        """Rows of the DiT batch."""
        ...

    def text_length(self, call: Call) -> int | None:
        """Text tokens of the call (None: not bucketed: fixed or native length)."""
        ...

    def pad(self, call: Call, batch_bucket: int, token_bucket: int | None) -> PaddedCall:
        """The call padded to `batch_bucket` rows and `token_bucket` text tokens."""
        ...

    def unpad(self, output: Any, padded: PaddedCall) -> Any:
        """The eager call's output from the padded call's: its real rows."""
        ...

    def signature(self, padded: PaddedCall) -> tuple[Any, ...]:
        """What identifies a captured graph: equal signatures replay the same kernels."""
        ...


# -- helpers -----------------------------------------------------------------------------------------


def repeat_last_row(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` (batch, ...) with its last row repeated up to `rows` rows (itself when it has them)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])])


def pad_tokens(t: torch.Tensor, length: int, value: float | bool = 0) -> torch.Tensor:
    """`t` (batch, tokens, ...) right-padded with `value` to `length` tokens."""
    if t.shape[1] >= length:
        return t
    pad = t.new_full((t.shape[0], length - t.shape[1], *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def call_signature(call: Mapping[str, Any]) -> tuple[Any, ...]:
    """Shapes, dtypes and devices of the call's tensors and the values of everything else, in order."""
    leaves, spec = tree_flatten(dict(call))
    parts: list[Any] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type))
        else:
            parts.append(leaf if _hashable(leaf) else repr(leaf))
    return tuple(parts)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _pad_batch_tensors(call: Call, names: Sequence[str], real: int, rows: int) -> None:
    """Repeat the last row of each named (batch, ...) tensor up to `rows` (broadcast ones stay)."""
    for name in names:
        t = call.get(name)
        if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] == real and real != rows:
            call[name] = repeat_last_row(t, rows)


def _pad_batch_lists(call: Call, names: Sequence[str], real: int, rows: int) -> None:
    """Repeat the last item of each named per-row list up to `rows` items (a one-item list serving the
    whole batch stays)."""
    for name in names:
        items = call.get(name)
        if isinstance(items, list | tuple) and len(items) == real and real != rows:
            call[name] = [*items, *[items[-1]] * (rows - real)]


# -- the contracts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixedLengthPadder:
    """A DiT whose text length never varies (or is already one of a few fixed sizes): only the batch is
    padded. `batch_tensors` / `batch_lists` name the arguments carrying one entry per row; `rows_from`
    the argument whose first dim is the batch."""

    rows_from: str
    batch_tensors: tuple[str, ...]
    batch_lists: tuple[str, ...] = ()
    contract: str = "fixed length"
    breaks_at_attention: bool = False

    def batch_size(self, call: Call) -> int:
        return len(call[self.rows_from])

    def text_length(self, call: Call) -> int | None:
        return None

    def pad(self, call: Call, batch_bucket: int, token_bucket: int | None) -> PaddedCall:
        real = self.batch_size(call)
        padded = dict(call)
        _pad_batch_tensors(padded, self.batch_tensors, real, batch_bucket)
        _pad_batch_lists(padded, self.batch_lists, real, batch_bucket)
        return PaddedCall(padded, real, batch_bucket, None, None)

    def unpad(self, output: Any, padded: PaddedCall) -> Any:
        return output[: padded.real_batch]

    def signature(self, padded: PaddedCall) -> tuple[Any, ...]:
        return call_signature(padded.call) + padded.extra


@dataclass(frozen=True)
class NativeLengthPadder(FixedLengthPadder):
    """Z-Image: the prompt keeps its own length (padding it would add attended tokens). Its captions are
    rounded up to a multiple of `multiple` inside the DiT, so the capture key holds the rounded lengths:
    two prompts of 20 and 25 tokens replay one graph. `caption_lists` name the per-row caption arguments
    (tensors, or named tuples with a `length` field)."""

    caption_lists: tuple[str, ...] = ()
    multiple: int = 1
    contract: str = "native length"

    def pad(self, call: Call, batch_bucket: int, token_bucket: int | None) -> PaddedCall:
        padded = super().pad(call, batch_bucket, token_bucket)
        lengths = tuple(
            math.ceil(_caption_length(item) / self.multiple) * self.multiple
            for name in self.caption_lists
            for item in (padded.call.get(name) or ())
        )
        return PaddedCall(padded.call, padded.real_batch, batch_bucket, None, None, extra=lengths)

    def signature(self, padded: PaddedCall) -> tuple[Any, ...]:
        # The real lengths only choose gather indices outside the captured blocks: the rounded ones in
        # `extra` stand for them.
        call = {
            name: [_without_length(item) for item in value] if name in self.caption_lists and value else value
            for name, value in padded.call.items()
        }
        return call_signature(call) + padded.extra


def _caption_length(item: Any) -> int:
    length = getattr(item, "length", None)
    return int(length) if length is not None else int(item.shape[0])


def _without_length(item: Any) -> Any:
    """A caption entry with its real length replaced by a placeholder (the rounded one is in the key)."""
    if hasattr(item, "_replace") and hasattr(item, "length"):
        return item._replace(length=-1)
    if isinstance(item, torch.Tensor):
        return ("caption", item.shape[1:], item.dtype, item.device.type)
    return item


@dataclass(frozen=True)
class MaskedTextPadder:
    """Text states (`text`, (batch, tokens, dim)) with a key mask (`mask`, (batch, tokens), None when no
    row is padded) that the DiT honours in every attention; the joint attention sequence is
    [text; image] (`image_tokens_from`: the (batch, tokens, ...) image argument). Padding the text to the
    token bucket inserts [text length, bucket) into it: the `AttentionSpan` the break points remove."""

    text: str
    mask: str
    image_tokens_from: str
    batch_tensors: tuple[str, ...]
    batch_lists: tuple[str, ...] = ()
    contract: str = "masked text"
    breaks_at_attention: bool = True

    def batch_size(self, call: Call) -> int:
        return int(call[self.text].shape[0])

    def text_length(self, call: Call) -> int | None:
        return int(call[self.text].shape[1])

    def pad(self, call: Call, batch_bucket: int, token_bucket: int | None) -> PaddedCall:
        if token_bucket is None:
            raise ValueError(f"{type(self).__name__} pads the text: it needs a token bucket")
        real, length = self.batch_size(call), self.text_length(call)
        assert length is not None
        text: torch.Tensor = call[self.text]
        mask: torch.Tensor | None = call.get(self.mask)
        made = mask is None
        if mask is None:  # kept at batch 1 too: the replay must not attend the padding
            mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
        padded = dict(call)
        padded[self.text] = pad_tokens(text, token_bucket)
        padded[self.mask] = pad_tokens(mask.to(torch.bool), token_bucket, False)
        _pad_batch_tensors(padded, (*self.batch_tensors, self.text, self.mask), real, batch_bucket)
        _pad_batch_lists(padded, self.batch_lists, real, batch_bucket)
        image_tokens = int(call[self.image_tokens_from].shape[1])
        span = AttentionSpan(length, token_bucket, token_bucket + image_tokens, made)
        return PaddedCall(padded, real, batch_bucket, length, token_bucket, span)

    def unpad(self, output: Any, padded: PaddedCall) -> Any:
        return output[: padded.real_batch]

    def signature(self, padded: PaddedCall) -> tuple[Any, ...]:
        return call_signature(padded.call)


def padder_for(dit: torch.nn.Module, padders: Mapping[str, PromptPadder]) -> PromptPadder | None:
    """The padder of `dit`'s class (by its Diffusers name) in `padders` (the registry's `PROMPT_PADDERS`,
    built from the families' records), or None when its family has none."""
    name = getattr(dit, "diffusers_class_name", type(dit).__name__)
    return padders.get(name)
