"""FLUX's blocks as one ordered sequence runnable in ranges (`models/cache_methods/blocks.BlockRange`):
the double-stream blocks (image and text streams), then the single-stream blocks (one joint [text; image]
sequence), as cache-dit counts them for DBCache's Fn/Bn.

A range of single-stream blocks joins the streams at its start and splits them at its end (copies, no
arithmetic); the model's last block computes the image rows only (`FluxSingleTransformerBlock`'s
`text_len`), so a range ending there returns no text stream. Running `[0, a)`, `[a, b)`, ... gives each
row the values of `FluxTransformer2DModel._run_blocks`. FLUX.2 has the same two kinds of blocks and uses
this class too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from diffserve.distributed.sequence_split import sequence_split
from diffserve.layers.rotary import RopeTables
from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.controlnets.residuals import ResidualGroups
from diffserve.models.step_cache import take_rows

#: A double-stream block's call: (x, ctx, its adaLN vectors, rope) -> (ctx, x).
DoubleCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, list[torch.Tensor], RopeTables], tuple]
#: A single-stream block's call: (h, its adaLN vectors, rope, text_len or None) -> h.
SingleCall = Callable[[nn.Module, torch.Tensor, list[torch.Tensor], RopeTables, int | None], torch.Tensor]


def flux_double(block: nn.Module, x, ctx, mods: list[torch.Tensor], rope: RopeTables) -> tuple:
    """FLUX.1's double-stream block: its image and text adaLN vectors."""
    return block(x, ctx, mods[0], mods[1], rope)


def flux_single(block: nn.Module, h, mods: list[torch.Tensor], rope: RopeTables, text_len: int | None):
    """FLUX.1's single-stream block: its adaLN vectors; `text_len` for the model's last block."""
    return block(h, mods[0], rope) if text_len is None else block(h, mods[0], rope, text_len=text_len)


class FluxBlockRange:
    """One forward's blocks: `mods[i]` are block i's per-row adaLN vectors (each a list: FLUX.1's
    double-stream blocks take two, its single-stream blocks one), `rope` the shared tables, `controls`
    the ControlNet residuals of some rows (FLUX.1), added after each block as the whole forward adds them."""

    def __init__(
        self,
        double_blocks: Sequence[nn.Module],
        single_blocks: Sequence[nn.Module],
        x: torch.Tensor,
        ctx: torch.Tensor,
        mods: Sequence[list[torch.Tensor]],
        rope: RopeTables,
        double: DoubleCall = flux_double,
        single: SingleCall = flux_single,
        controls: ResidualGroups | None = None,
    ) -> None:
        if sequence_split([ctx.shape[1], x.shape[1]]) is not None:
            raise RuntimeError(
                "cache methods that run FLUX's blocks in ranges (dbcache) do not support sequence "
                "parallelism yet; use a whole-span method (teacache, magcache, taylorseer, scm)"
            )
        self.double_blocks, self.single_blocks = list(double_blocks), list(single_blocks)
        self.x, self.ctx, self.mods, self.rope = x, ctx, list(mods), rope
        self.double, self.single = double, single
        self.controls = controls
        if len(self.mods) != self.num_blocks:
            raise ValueError(f"{len(self.mods)} blocks' adaLN vectors for {self.num_blocks} blocks")

    @property
    def num_blocks(self) -> int:
        return len(self.double_blocks) + len(self.single_blocks)

    def start(self) -> Streams:
        return Streams(self.x, self.ctx)

    def _mods(self, i: int, rows: torch.Tensor | None) -> list[torch.Tensor]:
        return [take_rows(m, rows) for m in self.mods[i]]

    def run(self, streams: Streams, rows: torch.Tensor | None, start: int, stop: int) -> Streams:
        x, ctx = streams.image, streams.text
        if ctx is None:
            raise RuntimeError("FLUX's blocks need the text stream, which only the last block drops")
        n_double, n_single = len(self.double_blocks), len(self.single_blocks)
        controls = None if self.controls is None else self.controls.take(rows)
        for i in range(start, min(stop, n_double)):
            ctx, x = self.double(self.double_blocks[i], x, ctx, self._mods(i, rows), self.rope)
            if controls is not None:
                x = controls.add("double", i, n_double, x)
        if stop <= n_double:
            return Streams(x, ctx)
        text_len = ctx.shape[1]
        h = torch.cat([ctx, x], dim=1)
        for i in range(max(start, n_double), stop):
            block, mods = self.single_blocks[i - n_double], self._mods(i, rows)
            if i == self.num_blocks - 1:
                x = self.single(block, h, mods, self.rope, text_len)
                if controls is not None:
                    x = controls.add("single", i - n_double, n_single, x)
                return Streams(x, None)
            h = self.single(block, h, mods, self.rope, None)
            if controls is not None:
                controls.add_in_place("single", i - n_double, n_single, h[:, text_len:])
        return Streams(h[:, text_len:], h[:, :text_len])
