"""How a DiT splits its token streams over the sequence-parallel ranks, and the attention its blocks call.

A DiT forward asks `sequence_split(lengths)` for its streams' shards (one `SequenceShard` per stream,
e.g. [text, image]); None means one sequence-parallel rank, and the forward runs as on one device.
Otherwise it splits each stream (`split`), its RoPE tables (`split_rope`), runs its blocks inside
`split.attention_scope(...)`, where `sequence_attention` (what the blocks call for self-attention over
the sequence) is USP attention over the Ulysses and Ring groups with the shards' padding masked, and
gathers the streams it returns (`gather`). Cross-attention to replicated keys (Wan's text) calls
plain `attention()` and needs no communication.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from diffserve.distributed.sequence_parallel import SequenceShard, as_key_mask, joint_key_valid, usp_attention
from diffserve.distributed.state import current_parallel_state
from diffserve.layers.attention import attention


@dataclass(frozen=True)
class _ShardedAttention:
    ulysses_group: ProcessGroup
    ring_group: ProcessGroup
    key_valid: torch.Tensor | None  # (batch, local joint seq): False at padded positions


_active: ContextVar[_ShardedAttention | None] = ContextVar("diffserve_sharded_attention", default=None)


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Self-attention over the token sequence, (batch, seq, heads, head_dim) in and out: plain
    `attention()` outside a split forward; inside one, USP attention over every rank's shard, the
    shards' padding and `attn_mask` (a per-key mask over this rank's local keys: (batch, seq_k) or
    (batch, 1, 1, seq_k) bool) masked."""
    if torch.compiler.is_compiling():
        # Compiled graphs (`--compile`) cannot read a ContextVar; the engine refuses --compile together
        # with sequence parallelism, so a compiled forward never runs split.
        return attention(q, k, v, attn_mask)
    sharded = _active.get()
    if sharded is None:
        return attention(q, k, v, attn_mask)
    key_valid = sharded.key_valid
    if attn_mask is not None:
        model_mask = as_key_mask(attn_mask, q.shape[0], k.shape[1])
        key_valid = model_mask if key_valid is None else key_valid & model_mask
    return usp_attention(q, k, v, sharded.ulysses_group, sharded.ring_group, key_valid)


@dataclass(frozen=True)
class SequenceSplit:
    """The shards of one forward's token streams (in joint order, e.g. [text, image]) on this rank."""

    shards: tuple[SequenceShard, ...]
    group: ProcessGroup  # every sequence-parallel rank, in shard order
    ulysses_group: ProcessGroup
    ring_group: ProcessGroup

    def split(self, stream: int, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of stream `stream` (zero-padded at the end when the length does not divide)."""
        return self.shards[stream].split(x, dim)

    def split_rope(self, tables: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """RoPE tables over the joint sequence -> the tables of this rank's local joint sequence, the
        streams' shards concatenated in the same order. A table is (seq, d), shared by the batch, or
        (batch * seq, d), one block of joint-sequence rows per sample (Qwen-Image's per-sample tables):
        each block is split like the tokens and the local blocks stacked in the same layout."""
        joint = sum(shard.length for shard in self.shards)
        out = []
        for table in tables:
            blocks = table.unflatten(0, (-1, joint))  # (1 or batch, seq, d)
            parts, start = [], 0
            for shard in self.shards:
                parts.append(shard.split(blocks[:, start : start + shard.length], dim=1))
                start += shard.length
            out.append(torch.cat(parts, dim=1).flatten(0, 1))
        return tuple(out)

    def stream_scope(self, stream: int, batch: int, device: torch.device) -> AbstractContextManager[None]:
        """`attention_scope` over stream `stream` alone, for a self-attention only that stream takes
        part in (SD3.5's image-only `attn2`): the same shards, the key mask of that stream's padding."""
        only = SequenceSplit((self.shards[stream],), self.group, self.ulysses_group, self.ring_group)
        return only.attention_scope(batch, device)

    def local_lengths(self) -> list[int]:
        """Each stream's local (padded) length: where the local joint sequence's streams start and end."""
        return [shard.shard_len for shard in self.shards]

    @contextmanager
    def attention_scope(
        self, batch: int, device: torch.device, masks: Sequence[torch.Tensor | None] | None = None
    ) -> Iterator[None]:
        """Within the block: `sequence_attention` is USP attention with the shards' padding masked.
        `masks`: per stream, None or a per-key bool mask over the stream's full length (batch, length)."""
        masks = list(masks) if masks is not None else [None] * len(self.shards)
        key_valid = joint_key_valid(list(zip(self.shards, masks, strict=True)), batch, device)
        token = _active.set(_ShardedAttention(self.ulysses_group, self.ring_group, key_valid))
        try:
            yield
        finally:
            _active.reset(token)

    def gather(self, stream: int, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Stream `stream` whole again, from every rank's shard (its padding dropped)."""
        return self.shards[stream].gather(x, self.group, dim)


def sequence_split(lengths: Sequence[int]) -> SequenceSplit | None:
    """The split of streams of these lengths over the parallel state in scope; None when it has one
    sequence-parallel rank (or there is no parallel state: one device)."""
    state = current_parallel_state()
    if state is None or state.sp_degree == 1:
        return None
    shards = tuple(SequenceShard.for_group(length, state.sp_group) for length in lengths)
    return SequenceSplit(shards, state.sp_group, state.ulysses_group, state.ring_group)
