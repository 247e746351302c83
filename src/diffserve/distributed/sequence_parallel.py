"""Sequence-parallel self-attention over explicit `torch.distributed` process groups: Ulysses, Ring and
both combined (USP), with padding for sequences whose length does not divide the degree.

Every rank holds one shard of the token sequence (`SequenceShard.split`): the DiT runs its per-token
layers (norms, MLPs, projections, RoPE) on its shard only, and only self-attention needs the other
ranks' tokens. Tensors are (batch, seq, heads, head_dim), the layout of `diffserve.layers.attention`.

- `ulysses_attention`: an all-to-all turns (seq/P tokens, all heads) into (all tokens, heads/P); the
  local attention runs through `attention()` (the engine's backend choice is kept: flash/sage when no
  key mask is needed, SDPA otherwise); a second all-to-all turns it back. Exact up to the kernel's own
  rounding. Moves 4 x (tokens x heads x head_dim) / P elements per rank and call (q, k, v, out).
- `ring_attention`: each rank keeps its queries; the K/V blocks (with their key masks) travel around
  the ring by point-to-point send/recv, overlapped with the block computation, and the partial
  results are merged with an online (log-sum-exp) softmax. Moves 2 x (P-1)/P x (tokens x heads x
  head_dim) elements per rank and call, in P-1 steps.
- `usp_attention`: Ulysses inside the `ulysses_group`, Ring across the `ring_group` (xDiT's USP
  ordering): the Ulysses all-to-all first, the ring over the head slice, the all-to-all back.

Padding and masks. A sequence of `length` tokens is cut into `degree` shards of ceil(length/degree)
tokens, the last ones zero-padded. Padded positions must never be attended to as keys: each rank
passes `key_valid`, a bool (batch, local_seq) tensor, True where the key takes part. It is the shard's
padding mask combined with any per-key mask of the model (e.g. Qwen-Image's or Z-Image's text padding
mask, given as (batch, seq_k) or (batch, 1, 1, seq_k): see `as_key_mask`); it travels with its K/V.
Masks that vary per query ((batch, 1, seq_q, seq_k) with seq_q > 1) are not supported: they cannot be
split along the keys alone. Queries at padded positions compute values that `SequenceShard.gather`
drops. `key_valid=None` means every key is valid, and must be None on every rank or on none.

Heads not divisible by the Ulysses degree are zero-padded up to the next multiple (a zero query/key/
value head contributes zero output and is dropped after the return all-to-all): it costs
(padded - heads) / heads extra attention work and lets e.g. Z-Image (30 heads) or SD3.5-Large (38)
run Ulysses-4. Ring attention has no constraint on heads.

Joint [text | image] attention: shard each stream separately, concatenate the local shards (and their
key masks, `joint_key_valid`) and call the function once; attention does not depend on the order of
the keys, and each query's output comes back to the rank and position it came from. Cross-attention
(sharded queries, replicated text keys/values, as in Wan) needs no communication: callers use plain
`attention()` for it.

All functions are collectives: every rank of the group(s) must call them with tensors of the same
shape, in the same order. They work on any backend (gloo, nccl, ...): no device is named here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from diffserve.layers.attention import attention

#: Upper bound, in bytes, of the fp32 score matrix one ring block computes at once; queries are
#: processed in chunks that fit (the score matrix of a 37k x 37k block of 40 heads would be 228 GB).
RING_SCORE_BUDGET_BYTES = 256 * 1024**2

#: The local attention of a sequence-parallel scheme: (q, k, v, key_valid) -> out.
_LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class SequenceShard:
    """Where one rank's slice of a `length`-token sequence sits when cut into `degree` equal shards.

    Shard `index` covers positions [start, start + shard_len) of the sequence zero-padded to `padded_len`; the
    positions at or past `length` are padding. The rank's index in the group used for `gather` must
    equal `index` (`for_group` does that)."""

    length: int
    degree: int
    index: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"sequence length must be >= 1, got {self.length}")
        if self.degree < 1:
            raise ValueError(f"sequence-parallel degree must be >= 1, got {self.degree}")
        if not 0 <= self.index < self.degree:
            raise ValueError(f"shard index must be in [0, {self.degree}), got {self.index}")

    @classmethod
    def for_group(cls, length: int, group: ProcessGroup) -> SequenceShard:
        """The shard of this rank: degree = the group's size, index = this rank's rank in it."""
        return cls(length, dist.get_world_size(group), dist.get_rank(group))

    @property
    def shard_len(self) -> int:
        """Tokens per shard, padding included: ceil(length / degree)."""
        return math.ceil(self.length / self.degree)

    @property
    def padded_len(self) -> int:
        """The sequence length once padded: degree x shard_len."""
        return self.shard_len * self.degree

    @property
    def has_padding(self) -> bool:
        """Whether any shard (not necessarily this one) holds padding: then every rank needs a key mask."""
        return self.padded_len != self.length

    @property
    def start(self) -> int:
        """First position of this shard in the padded sequence."""
        return self.index * self.shard_len

    @property
    def valid_len(self) -> int:
        """Real (non-padding) tokens in this shard; 0 for a shard past the end of a short sequence."""
        return max(0, min(self.shard_len, self.length - self.start))

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This shard of `x` (whose `dim` has `length` entries), zero-padded at the end to `shard_len`.

        Use it for the hidden states and for everything indexed by token, e.g. RoPE tables."""
        if x.shape[dim] != self.length:
            raise ValueError(
                f"cannot shard dim {dim} of a tensor of shape {tuple(x.shape)}: expected {self.length} tokens"
            )
        local = x.narrow(dim, min(self.start, self.length), self.valid_len)
        missing = self.shard_len - self.valid_len
        if missing:
            pad_shape = list(x.shape)
            pad_shape[dim] = missing
            local = torch.cat([local, x.new_zeros(pad_shape)], dim=dim)
        return local.contiguous()

    def key_valid(
        self,
        batch: int,
        device: torch.device,
        mask: torch.Tensor | None = None,
        always: bool = False,
    ) -> torch.Tensor | None:
        """The bool (batch, shard_len) key mask of this shard: False at padding and where `mask` is False.

        `mask` is the model's per-key mask over the whole sequence, (batch, length) or
        (batch, 1, 1, length) bool, or None. Returns None when every key is valid (no padding anywhere,
        no mask) unless `always`, so the fast unmasked kernels stay usable."""
        if mask is None and not self.has_padding and not always:
            return None
        positions = torch.arange(self.shard_len, device=device)
        valid = (positions < self.valid_len).unsqueeze(0).expand(batch, -1)
        if mask is not None:
            key_mask = as_key_mask(mask, batch, self.length)
            valid = valid & self.split(key_mask.to(device), dim=1)
        return valid.contiguous()

    def gather(self, x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's shard `x` (all_gather, concatenate, drop the padding).

        `group` must be the group the shards were cut for: `degree` ranks, this rank at `index`."""
        if x.shape[dim] != self.shard_len:
            raise ValueError(
                f"cannot gather dim {dim} of a tensor of shape {tuple(x.shape)}: "
                f"expected a shard of {self.shard_len} tokens"
            )
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (self.degree, self.index):
            raise ValueError(
                f"group of size {size} with this rank at {rank} does not match shard {self.index} "
                f"of degree {self.degree}"
            )
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim).narrow(dim, 0, self.length)


def as_key_mask(mask: torch.Tensor, batch: int, seq_k: int) -> torch.Tensor:
    """`mask` as a bool (batch, seq_k) per-key mask (True: the key takes part).

    Accepts (batch, seq_k) and (batch, 1, 1, seq_k), the shape Qwen-Image and Z-Image pass to
    `attention()`; any other shape (e.g. a per-query (batch, 1, seq_q, seq_k) mask) raises ValueError."""
    if mask.dtype != torch.bool:
        raise ValueError(f"key mask must be bool, got {mask.dtype}")
    if mask.dim() == 4 and mask.shape[1:3] == (1, 1):
        mask = mask[:, 0, 0, :]
    if tuple(mask.shape) != (batch, seq_k):
        raise ValueError(
            f"key mask must have shape ({batch}, {seq_k}) or ({batch}, 1, 1, {seq_k}), got {tuple(mask.shape)}"
        )
    return mask


def joint_key_valid(
    parts: Sequence[tuple[SequenceShard, torch.Tensor | None]], batch: int, device: torch.device
) -> torch.Tensor | None:
    """The key mask of a joint sequence made of several separately sharded streams, e.g. [text | image].

    `parts` lists each stream's shard and its full-sequence per-key mask (or None), in the order the
    local shards are concatenated. None when every key of every stream is valid."""
    if all(mask is None and not shard.has_padding for shard, mask in parts):
        return None
    masks = [shard.key_valid(batch, device, mask, always=True) for shard, mask in parts]
    return torch.cat([m for m in masks if m is not None], dim=1)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None) -> None:
    """Raise ValueError unless q, k, v are (batch, seq, heads, head_dim) of one shape and dtype and
    `key_valid` is None or a bool (batch, seq) tensor."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "q, k, v must be (batch, seq, heads, head_dim) tensors of one shape, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if key_valid is not None and (key_valid.dtype != torch.bool or key_valid.shape != k.shape[:2]):
        raise ValueError(
            f"key_valid must be a bool tensor of shape {tuple(k.shape[:2])} (batch, local seq), "
            f"got {key_valid.dtype} {tuple(key_valid.shape)}"
        )


def _local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None
) -> torch.Tensor:
    """`attention()` (the active backend) with `key_valid` as a (batch, 1, 1, seq_k) mask."""
    mask = None if key_valid is None else key_valid[:, None, None, :]
    return attention(q, k, v, attn_mask=mask)


# ---------------------------------------------------------------------------------------------- Ulysses


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(n, s, P*h, d) with s local tokens and all heads -> (n, P*s, h, d): every token, this rank's h heads.

    Head group j goes to rank j; the token blocks arrive in rank order."""
    size = dist.get_world_size(group)
    n, s, heads, d = x.shape
    send = x.reshape(n, s, size, heads // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens, our head group
    return recv.permute(1, 0, 2, 3, 4).reshape(n, size * s, heads // size, d)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (n, P*s, h, d) -> (n, s, P*h, d)."""
    size = dist.get_world_size(group)
    n, total, heads, d = x.shape
    send = x.reshape(n, size, total // size, heads, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: our tokens, rank j's head group
    return recv.permute(1, 2, 0, 3, 4).reshape(n, total // size, size * heads, d)


def _gather_key_valid(key_valid: torch.Tensor | None, group: ProcessGroup) -> torch.Tensor | None:
    """Every rank's (batch, s) key mask concatenated in rank order: (batch, P*s), or None."""
    if key_valid is None:
        return None
    parts = [torch.empty_like(key_valid) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, key_valid.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _ulysses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    key_valid: torch.Tensor | None,
    inner: _LocalAttention,
) -> torch.Tensor:
    """Ulysses around `inner`: one all-to-all of q, k, v (stacked on the batch dim) to whole-sequence
    head slices, `inner` on them, one all-to-all back. Heads are zero-padded to a multiple of P."""
    size = dist.get_world_size(group)
    if size == 1:
        return inner(q, k, v, key_valid)
    batch, heads = q.shape[0], q.shape[2]
    padded_heads = math.ceil(heads / size) * size
    qkv = torch.cat([q, k, v], dim=0)
    if padded_heads != heads:
        qkv = F.pad(qkv, (0, 0, 0, padded_heads - heads))
    q_h, k_h, v_h = _seq_to_heads(qkv, group).split(batch, dim=0)
    out = inner(q_h, k_h, v_h, _gather_key_valid(key_valid, group))
    return _heads_to_seq(out, group)[:, :, :heads]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention of the whole sequence for this rank's shard of queries, by Ulysses over `group`.

    q, k, v: (batch, local seq, heads, head_dim), this rank's shard (all heads); key_valid: bool
    (batch, local seq) or None (see the module docstring). Returns (batch, local seq, heads, head_dim),
    still sharded. The local attention is `attention()` with the active backend."""
    _check_qkv(q, k, v, key_valid)
    return _ulysses(q, k, v, group, key_valid, _local_attention)


# ------------------------------------------------------------------------------------------------- Ring


def _block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of fp32 q (b, h, sq, d) over one K/V block (b, h, sk, d), and its log-sum-exp.

    Returns (out (b, h, sq, d), lse (b, h, sq)); a query with no valid key in the block gets out 0 and
    lse -inf. Queries are processed in chunks whose score matrix fits `RING_SCORE_BUDGET_BYTES`."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    scale = q.shape[-1] ** -0.5
    chunk = max(1, RING_SCORE_BUDGET_BYTES // (b * h * sk * 4))
    blocked = None if key_valid is None else ~key_valid[:, None, None, :]
    outs, lses = [], []
    for q_chunk in q.split(chunk, dim=2):
        scores = torch.matmul(q_chunk, k.transpose(-1, -2)).mul_(scale)
        if blocked is not None:
            scores.masked_fill_(blocked, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # all -inf row: exp() -> 0
        outs.append(torch.matmul(scores.sub_(shift.unsqueeze(-1)).exp_(), v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets: (out, lse) of the union."""
    new_lse = torch.logaddexp(lse, block_lse)
    shift = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    merged = out * (lse - shift).exp().unsqueeze(-1) + block_out * (block_lse - shift).exp().unsqueeze(-1)
    return merged, new_lse


def _ring_exchange(
    tensors: list[torch.Tensor], group: ProcessGroup
) -> tuple[list[torch.Tensor], list[dist.Work]]:
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % size)
    prev_rank = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, next_rank, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prev_rank, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    key_valid: torch.Tensor | None,
) -> torch.Tensor:
    """Ring attention proper (inputs checked): P blocks, the next block's transfer overlapping the
    current block's computation, merged in fp32."""
    size = dist.get_world_size(group)
    if size == 1:
        return _local_attention(q, k, v, key_valid)
    query = q.transpose(1, 2).float()
    block = [torch.stack([k, v]).transpose(2, 3).contiguous()]  # (2, b, h, sk, d), sent in q's dtype
    if key_valid is not None:
        block.append(key_valid.contiguous())
    partial: tuple[torch.Tensor, torch.Tensor] | None = None  # (out, lse) over the blocks seen so far
    for step in range(size):
        pending = _ring_exchange(block, group) if step < size - 1 else None
        kv = block[0].float()
        result = _block_attention(query, kv[0], kv[1], block[1] if len(block) > 1 else None)
        partial = result if partial is None else _merge(*partial, *result)
        if pending is not None:
            received, works = pending
            for work in works:
                work.wait()
            block = received
    assert partial is not None  # size >= 2 blocks were computed
    return partial[0].transpose(1, 2).to(q.dtype)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention of the whole sequence for this rank's shard of queries, by Ring over `group`.

    q, k, v: (batch, local seq, heads, head_dim), this rank's shard; key_valid: bool (batch, local seq)
    or None (module docstring). Returns (batch, local seq, heads, head_dim), still sharded.

    Cost: the blocks are computed explicitly in fp32 (q @ k^T, mask, log-sum-exp, softmax @ v), since
    SDPA does not return the log-sum-exp the merge needs. That is unfused: the (queries x keys) score
    matrix goes through memory (bounded by `RING_SCORE_BUDGET_BYTES` per chunk of queries), and fp32
    matmuls run well below bf16 tensor-core speed, so on GPUs expect it several times slower than
    flash attention for the same block; a fused kernel that returns the LSE (flash-attn's
    `return_attn_probs`) is the fast path to add. K/V travel in the input dtype. With one rank it is
    plain `attention()`."""
    _check_qkv(q, k, v, key_valid)
    return _ring(q, k, v, group, key_valid)


# -------------------------------------------------------------------------------------------------- USP


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: ProcessGroup,
    ring_group: ProcessGroup,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention of the whole sequence by Ulysses over `ulysses_group` and Ring over `ring_group`.

    The sequence is sharded over all U x R ranks (e.g. `SequenceShard.for_group` on a group spanning
    both); the members of one ring group must hold the same rank in their Ulysses groups (the usual
    grid: ulysses groups are the rows, ring groups the columns), so that they hold the same head
    slice after the all-to-all. Shapes as in `ulysses_attention`; with R = 1 it is Ulysses, with
    U = 1 Ring."""
    _check_qkv(q, k, v, key_valid)

    def ring_over_heads(
        q_h: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor, valid: torch.Tensor | None
    ) -> torch.Tensor:
        return _ring(q_h, k_h, v_h, ring_group, valid)

    return _ulysses(q, k, v, ulysses_group, key_valid, ring_over_heads)
