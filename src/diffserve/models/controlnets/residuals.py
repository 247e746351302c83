"""The per-block residuals a ControlNet hands the FLUX DiT, for some rows of its batch.

Diffusers' `FluxTransformer2DModel` takes `controlnet_block_samples` (one per ControlNet double-stream
block) and `controlnet_single_block_samples`, and adds, after DiT block `i`, the sample
`i // ceil(n_blocks / n_samples)` to the image stream (XLabs' ControlNets: `i % n_samples` for the
double-stream blocks, `controlnet_blocks_repeat`); SD3's transformer adds sample
`int(i / (n_blocks / n_samples))` (`truncating`). `BlockResiduals` holds those samples for the rows of
a step's batch that use a ControlNet: the other rows are not touched, so they keep the values of a batch
without any ControlNet, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def scaled_samples(samples: Sequence[torch.Tensor], scales: torch.Tensor) -> list[torch.Tensor]:
    """Each ControlNet sample (rows, tokens, inner) times its row's conditioning scale (`scales`, (rows,)),
    as Diffusers' `sample * conditioning_scale` with a Python float: the product is computed in float32
    for a reduced-precision sample, then rounded once."""
    if not samples:
        return []
    per_row = scales.to(device=samples[0].device, dtype=torch.float32)[:, None, None]
    return [(s.float() * per_row).to(s.dtype) for s in samples]


@dataclass(frozen=True)
class BlockResiduals:
    """Samples of shape (len(rows), image tokens, inner) each, for the batch rows `rows` (None: every row,
    in order). `repeat`: XLabs' cycling of the double-stream samples; `truncating`: SD3's float interval,
    truncated, instead of the ceiled integer one."""

    double: Sequence[torch.Tensor]
    single: Sequence[torch.Tensor]
    rows: tuple[int, ...] | None = None
    repeat: bool = False
    truncating: bool = False

    def __post_init__(self) -> None:
        if self.rows is not None and len(set(self.rows)) != len(self.rows):
            raise ValueError(f"ControlNet residual rows must be distinct, got {self.rows}")

    def sample(self, kind: str, index: int, num_blocks: int) -> torch.Tensor | None:
        """The sample added after DiT block `index` of the `num_blocks` of `kind` ("double" or "single"),
        by Diffusers' interval arithmetic; None when there are no samples of that kind."""
        samples = self.double if kind == "double" else self.single
        if not samples:
            return None
        if kind == "double" and self.repeat:
            return samples[index % len(samples)]
        if self.truncating:
            return samples[int(index / (num_blocks / len(samples)))]
        interval = math.ceil(num_blocks / len(samples))
        return samples[index // interval]

    def add(self, kind: str, index: int, num_blocks: int, image: torch.Tensor) -> torch.Tensor:
        """`image` (batch, image tokens, inner) with block `index`'s sample added to the rows it has; the
        other rows keep their values (a fresh tensor for the image stream, `image` itself otherwise)."""
        sample = self.sample(kind, index, num_blocks)
        if sample is None:
            return image
        if self.rows is None:
            return image + sample
        rows = torch.tensor(self.rows, device=image.device)
        out = image.clone()
        out[rows] = image.index_select(0, rows) + sample
        return out

    def add_in_place(self, kind: str, index: int, num_blocks: int, image: torch.Tensor) -> None:
        """The same, written into `image` (a view of a single-stream block's fresh output)."""
        sample = self.sample(kind, index, num_blocks)
        if sample is None:
            return
        if self.rows is None:
            image.add_(sample)
            return
        rows = torch.tensor(self.rows, device=image.device)
        image[rows] = image.index_select(0, rows) + sample

    def map_tokens(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockResiduals:
        """The same residuals with every sample's token axis remapped by `fn` (rows untouched): under
        sequence parallelism, this rank's shard of the image tokens (`SequenceSplit.split`), so each rank
        adds the slice of the whole-sequence residuals that matches the image tokens it holds."""
        return BlockResiduals(
            double=[fn(s) for s in self.double],
            single=[fn(s) for s in self.single],
            rows=self.rows,
            repeat=self.repeat,
            truncating=self.truncating,
        )

    def take(self, rows: torch.Tensor | None) -> BlockResiduals | None:
        """The residuals of a forward over batch rows `rows` only (a step cache's computed rows; None: all),
        renumbered to positions within `rows`; None when none of `rows` has any."""
        if rows is None:
            return self
        wanted = [int(r) for r in rows.tolist()]
        # Batch row -> its sample's index (every row's, in order, when `self.rows` is None).
        if self.rows is None:
            position = {row: row for row in wanted}
        else:
            position = {row: i for i, row in enumerate(self.rows)}
        hits = [(i, position[row]) for i, row in enumerate(wanted) if row in position]
        if not hits:
            return None
        new_rows = tuple(i for i, _ in hits)
        picks = torch.tensor([p for _, p in hits], device=(self.double or self.single)[0].device)
        return BlockResiduals(
            double=[s.index_select(0, picks) for s in self.double],
            single=[s.index_select(0, picks) for s in self.single],
            rows=new_rows,
            repeat=self.repeat,
            truncating=self.truncating,
        )


@dataclass(frozen=True)
class ResidualGroups:
    """Several `BlockResiduals` on disjoint rows of one batch (requests whose ControlNets have other block
    counts): each adds its samples to its own rows."""

    groups: tuple[BlockResiduals, ...]

    def add(self, kind: str, index: int, num_blocks: int, image: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            image = group.add(kind, index, num_blocks, image)
        return image

    def add_in_place(self, kind: str, index: int, num_blocks: int, image: torch.Tensor) -> None:
        for group in self.groups:
            group.add_in_place(kind, index, num_blocks, image)

    def map_tokens(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ResidualGroups:
        """Every group's `BlockResiduals.map_tokens`."""
        return ResidualGroups(tuple(group.map_tokens(fn) for group in self.groups))

    def take(self, rows: torch.Tensor | None) -> ResidualGroups | None:
        kept = tuple(g for g in (group.take(rows) for group in self.groups) if g is not None)
        return ResidualGroups(kept) if kept else None
