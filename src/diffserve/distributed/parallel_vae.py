"""Patch-parallel VAE decode: the latent's rows split over the ranks, the same image out.

Every rank ends the denoising loop holding the same latents (sequence-parallel forwards gather their
output, CFG-parallel combines both branches on both ranks), so the decode is split over *all* ranks
of the world (CFG, TP, Ring and Ulysses alike): rank i decodes a contiguous band of latent rows
(`balanced_rows`: the first `rows % N` ranks take one more). Inside `row_split_scope(split)` the
decoder's layers that look across rows take part (each layer class reads `current_row_split()`; on
one device, or outside the scope, they are the plain torch layers, bit for bit):

- a convolution with a spatial kernel (3x3, 3x3x3) first takes `kernel // 2` halo rows from the
  rank above and the rank below (`with_halo_rows`: point-to-point send/recv), zeros at the true image
  border only, and runs without row padding: each output row sees exactly the rows it sees on one
  device;
- GroupNorm normalises with the statistics of the whole image (`split_group_norm`: each rank's
  per-group mean and centred sum of squares in fp32, all-gathered and merged, Chan's formula), then
  applies them as torch's kernel does (`x * (rstd * weight) + (bias - mean * rstd * weight)`);
- self-attention over the pixels keeps its local queries and attends over every rank's keys and
  values (`gather_rows`);
- nearest 2x upsampling is local (output row r reads input row r // 2), so the band of every rank
  doubles with it; the halo sizes stay those of the kernels.

`decode_split(vae, latents)` is what a decoding stage calls: it splits, decodes under the scope and
all-gathers the output rows, so every rank returns the whole image. It decodes unsplit when there is
no parallel state, one rank, a VAE whose layers do not take part (not a `RowSplitDecoder`), a VAE with
tiling on, or fewer latent rows than ranks (each rank needs at least one row: its neighbours' halos come
from it).
Row is the second-to-last dimension everywhere: (B, C, H, W) images and (B, C, T, H, W) videos.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from diffserve.distributed.state import current_parallel_state
from diffserve.vae_tiling import SupportsTiling, requested_tiling

#: Dimension of the rows in every tensor of a split decode (H of (..., H, W)).
ROW_DIM = -2


@runtime_checkable
class RowSplitDecoder(Protocol):
    """A VAE whose decoder layers take part in a row-split decode (they read `current_row_split()`)."""

    decodes_row_split: ClassVar[bool]

    def decode(self, z: torch.Tensor) -> torch.Tensor: ...


def balanced_rows(rows: int, degree: int) -> tuple[int, ...]:
    """`rows` split into `degree` contiguous bands, the first `rows % degree` one row longer."""
    if degree < 1 or rows < degree:
        raise ValueError(f"cannot split {rows} rows over {degree} ranks (each needs at least one row)")
    base, extra = divmod(rows, degree)
    return tuple(base + (1 if i < extra else 0) for i in range(degree))


@dataclass(frozen=True)
class RowSplit:
    """One decode's bands of latent rows over a process group, as seen from one of its ranks."""

    group: dist.ProcessGroup
    rank: int  # this rank's index in `group`
    peers: tuple[int, ...]  # the group's global ranks, by group index (point-to-point addresses)
    rows: tuple[int, ...]  # latent rows of each group index, in image order

    @classmethod
    def over(cls, group: dist.ProcessGroup, latent_rows: int) -> RowSplit | None:
        """The balanced split of `latent_rows` over `group`; None when it has fewer rows than ranks."""
        size = dist.get_world_size(group)
        if latent_rows < size:
            return None
        peers = tuple(dist.get_process_group_ranks(group))
        return cls(group, dist.get_rank(group), peers, balanced_rows(latent_rows, size))

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def start(self) -> int:
        """This rank's first latent row."""
        return sum(self.rows[: self.rank])

    def counts(self, local_rows: int) -> list[int]:
        """Every rank's rows at the scale where this rank holds `local_rows` (bands scale together)."""
        mine = self.rows[self.rank]
        if local_rows % mine:
            raise RuntimeError(
                f"rank {self.rank} holds {local_rows} rows, not a multiple of its {mine} latent rows: "
                "a layer changed the row count other than by whole-band scaling"
            )
        return [rows * (local_rows // mine) for rows in self.rows]

    def take(self, latents: torch.Tensor) -> torch.Tensor:
        """This rank's band of the full `latents`."""
        return latents.narrow(ROW_DIM, self.start, self.rows[self.rank])


_current: ContextVar[RowSplit | None] = ContextVar("diffserve_row_split", default=None)


@contextmanager
def row_split_scope(split: RowSplit | None) -> Iterator[RowSplit | None]:
    """Make `split` the one the decoder layers see in this thread/task until the block exits."""
    token = _current.set(split)
    try:
        yield split
    finally:
        _current.reset(token)


def current_row_split() -> RowSplit | None:
    """The split decode in progress here, or None (one device, or not decoding split)."""
    return _current.get()


# -- Communication ---------------------------------------------------------------------------------


def with_halo_rows(x: torch.Tensor, halo: int, split: RowSplit) -> torch.Tensor:
    """`x` (this rank's band) with `halo` rows of each neighbour's band above and below it, zeros past
    the image's first and last row: what a kernel of `2 * halo + 1` rows needs, without row padding."""
    rows = x.shape[ROW_DIM]
    if halo == 0:
        return x
    if min(split.counts(rows)) < halo:
        raise RuntimeError(f"a band of {min(split.counts(rows))} rows cannot lend a halo of {halo} rows")
    shape = list(x.shape)
    shape[ROW_DIM] = halo
    above = torch.zeros(shape, dtype=x.dtype, device=x.device)
    below = torch.zeros(shape, dtype=x.dtype, device=x.device)
    ops = []
    if split.rank > 0:
        peer = split.peers[split.rank - 1]
        ops.append(dist.P2POp(dist.isend, x.narrow(ROW_DIM, 0, halo).contiguous(), peer, split.group))
        ops.append(dist.P2POp(dist.irecv, above, peer, split.group))
    if split.rank < split.size - 1:
        peer = split.peers[split.rank + 1]
        ops.append(
            dist.P2POp(dist.isend, x.narrow(ROW_DIM, rows - halo, halo).contiguous(), peer, split.group)
        )
        ops.append(dist.P2POp(dist.irecv, below, peer, split.group))
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return torch.cat([above, x, below], dim=ROW_DIM)


def gather_rows(x: torch.Tensor, counts: Sequence[int], dim: int, split: RowSplit) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order, where rank i's has `counts[i]` entries
    there (bands differ by a row: each is padded to the longest for the all-gather, then trimmed)."""
    longest = max(counts)
    dim = dim % x.ndim
    padded = x
    if x.shape[dim] < longest:
        pad = [0, 0] * (x.ndim - 1 - dim) + [0, longest - x.shape[dim]]
        padded = F.pad(x, pad)
    padded = padded.contiguous()
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=split.group)
    return torch.cat([part.narrow(dim, 0, count) for part, count in zip(parts, counts, strict=True)], dim=dim)


# -- Layers ------------------------------------------------------------------------------------------


def halo_conv2d(conv: nn.Conv2d, x: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """`conv(x)` on this rank's band: the halo rows stand in for the row padding."""
    check_halo_conv(conv, conv.padding[0])
    x = with_halo_rows(x, conv.padding[0], split)
    padding = (0, conv.padding[1])
    return F.conv2d(x, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)


def check_halo_conv(conv: nn.Conv2d | nn.Conv3d, row_padding: int) -> None:
    """Refuse a convolution a halo exchange cannot split exactly: strided or dilated along the rows,
    non-zero padding modes, or row padding other than half the kernel's rows."""
    kernel_rows = conv.kernel_size[-2]
    if conv.stride[-2] != 1 or conv.dilation[-2] != 1 or conv.padding_mode != "zeros":
        raise NotImplementedError(
            f"{type(conv).__name__} with row stride {conv.stride[-2]}, dilation {conv.dilation[-2]}, "
            f"padding mode {conv.padding_mode!r} cannot run in a row-split decode"
        )
    if row_padding != kernel_rows // 2:
        raise NotImplementedError(
            f"row padding {row_padding} of a {kernel_rows}-row kernel in a row-split decode"
        )


class HaloConv2d(nn.Conv2d):
    """`nn.Conv2d` that, inside a row-split decode, takes its halo rows from the neighbouring ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = current_row_split()
        if split is None:
            return super().forward(x)
        return halo_conv2d(self, x, split)


def split_group_norm(norm: nn.GroupNorm, x: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """`norm(x)` with the statistics of every rank's band of the image, in fp32."""
    b, c = x.shape[:2]
    groups = norm.num_groups
    grouped = x.unflatten(1, (groups, c // groups)).float()  # a view for fp32 (any memory format)
    reduce_dims = tuple(range(2, grouped.ndim))
    var, mean = torch.var_mean(grouped, dim=reduce_dims, correction=0)  # (B, G) each
    per_row = grouped[0, 0].numel() // x.shape[ROW_DIM]  # elements of one group in one row
    counts = torch.tensor(split.counts(x.shape[ROW_DIM]), dtype=torch.float32, device=x.device) * per_row
    stats = torch.stack([mean, var], dim=-1).contiguous()  # (B, G, 2)
    gathered = [torch.empty_like(stats) for _ in range(split.size)]
    dist.all_gather(gathered, stats, group=split.group)
    means, variances = torch.stack(gathered).unbind(-1)  # (ranks, B, G)
    weights = counts.view(-1, 1, 1)
    total = counts.sum()
    global_mean = (weights * means).sum(0) / total
    # Chan et al.: the centred sums of squares of the bands, plus each band's offset from the mean.
    m2 = (weights * (variances + (means - global_mean) ** 2)).sum(0)
    rstd = torch.rsqrt(m2 / total + norm.eps)  # (B, G)
    scale = rstd.repeat_interleave(c // groups, dim=1)  # (B, C)
    shift = -global_mean.repeat_interleave(c // groups, dim=1) * scale
    if norm.affine:
        scale = scale * norm.weight.float()
        shift = shift * norm.weight.float() + norm.bias.float()
    trailing = (1,) * (x.ndim - 2)
    scale, shift = scale.view(b, c, *trailing), shift.view(b, c, *trailing)
    if x.dtype == torch.float32:
        return torch.addcmul(shift, x, scale)
    return torch.addcmul(shift, x.float(), scale).to(x.dtype)


class SplitGroupNorm(nn.GroupNorm):
    """`nn.GroupNorm` that, inside a row-split decode, normalises with whole-image statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = current_row_split()
        if split is None:
            return super().forward(x)
        return split_group_norm(self, x, split)


def gather_tokens(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """Inside a split decode, every rank's (B, rows x `width`, ...) tokens in image order (the keys and
    values a pixel attention needs); `tokens` itself otherwise."""
    split = current_row_split()
    if split is None:
        return tokens
    counts = [rows * width for rows in split.counts(tokens.shape[1] // width)]
    return gather_rows(tokens, counts, dim=1, split=split)


# -- The decode ----------------------------------------------------------------------------------------


def decode_split(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """`vae.decode(latents)`, split by rows over every rank when a parallel state is in scope and the
    VAE takes part (see the module docstring); every rank returns the whole output. A VAE with tiling on
    (`--vae-tiling`) decodes its tiles unsplit on every rank: tiling already bounds the decode's memory,
    and the halo exchange assumes one band per rank of the whole frame."""
    with requested_tiling(vae):  # the engine's automatic tiling of this request's decode (one device)
        if isinstance(vae, SupportsTiling) and vae.use_tiling:
            return vae.decode(latents)
    if not isinstance(vae, RowSplitDecoder):
        return vae.decode(latents)
    state = current_parallel_state()
    if state is None or state.world_size == 1:
        return vae.decode(latents)
    split = RowSplit.over(dist.group.WORLD, latents.shape[ROW_DIM])
    if split is None:
        return vae.decode(latents)
    return decode_rows(vae, latents, split)


def decode_rows(vae: RowSplitDecoder, latents: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """Decode this rank's band of `latents` under `split`, then all-gather the output bands."""
    with row_split_scope(split):
        band = vae.decode(split.take(latents))
    factor, remainder = divmod(band.shape[ROW_DIM], split.rows[split.rank])
    if remainder:
        raise RuntimeError(f"{split.rows[split.rank]} latent rows decoded to {band.shape[ROW_DIM]} rows")
    return gather_rows(band, [rows * factor for rows in split.rows], ROW_DIM, split)
