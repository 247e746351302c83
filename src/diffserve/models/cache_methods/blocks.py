"""What a DiT exposes so that a cache method can run its blocks in ranges: `Streams` and `BlockRange`.

A cache method such as DBCache runs the first blocks, decides, then runs or skips the middle ones and
runs the last ones; requests in one DiT batch may cut at different blocks. So a DiT that supports it
hands the cache, per forward, a `BlockRange`: its blocks as one ordered sequence (FLUX: the double-stream
blocks, then the single-stream ones) that runs any range `[start, stop)` on any rows, with the per-row
inputs (timestep modulation, text, masks) bound inside it.

Between two blocks the hidden state is `Streams`: the image tokens the output head reads, and, for
dual-stream DiTs, the text tokens the blocks update (FLUX's single-stream blocks keep one joint sequence;
their range splits it into the two streams at its ends, which copies values and changes none). Residuals
and cached values are `Streams` too, so reusing the middle blocks adds to both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Streams:
    """The hidden state between two blocks, for some batch rows: `image` (rows, tokens, dim) and `text`
    (rows, text tokens, dim), None for DiTs whose blocks do not update a text stream and after the last
    block (nothing reads it there)."""

    image: torch.Tensor
    text: torch.Tensor | None = None

    def take(self, rows: torch.Tensor) -> Streams:
        """These streams restricted to batch rows `rows`."""
        text = None if self.text is None else self.text.index_select(0, rows)
        return Streams(self.image.index_select(0, rows), text)

    def put(self, rows: torch.Tensor, part: Streams) -> Streams:
        """A copy with batch rows `rows` replaced by `part` (a text-less `part`, the output of the last
        block, drops the text stream: nothing reads it after the last block)."""
        text = None if self.text is None or part.text is None else self.text.index_copy(0, rows, part.text)
        return Streams(self.image.index_copy(0, rows, part.image), text)

    def minus(self, other: Streams) -> Streams:
        """The residual `self - other`, stream by stream (text only where both have it)."""
        text = None if self.text is None or other.text is None else self.text - other.text
        return Streams(self.image - other.image, text)

    def plus(self, residual: Streams, need_text: bool) -> Streams:
        """`self + residual`, stream by stream. `need_text`: blocks still follow, which read the text
        stream, so the residual must carry one (RuntimeError otherwise)."""
        if not need_text or self.text is None:  # the text is read no more (or there is none)
            return Streams(self.image + residual.image, self.text)
        if residual.text is None:
            raise RuntimeError("the cached residual has no text stream, which the blocks after it read")
        return Streams(
            self.image + residual.image, self.text + _text_width(residual.text, self.text.shape[1])
        )


def _text_width(text: torch.Tensor, width: int) -> torch.Tensor:
    """A cached text residual cut or zero-padded to this step's text width. DiTs that pad every row's
    text to the batch's longest (Qwen-Image, Z-Image) give a request another width when the batch around
    it changes; the positions past a row's own text are padding that attention masks as keys and the
    output head never reads, so what the residual holds there changes nothing."""
    if text.shape[1] == width:
        return text
    if text.shape[1] > width:
        return text[:, :width]
    return torch.nn.functional.pad(text, (0, 0, 0, width - text.shape[1]))


class BlockRange(Protocol):
    """A DiT forward's blocks as one ordered sequence of `num_blocks`, runnable in ranges."""

    @property
    def num_blocks(self) -> int: ...

    def start(self) -> Streams:
        """The first block's input, every row of the batch."""
        ...

    def run(self, streams: Streams, rows: torch.Tensor | None, start: int, stop: int) -> Streams:
        """Blocks `[start, stop)` on `streams`, which hold batch rows `rows` (None: every row): per-row
        inputs are taken for those rows. Running the ranges `[0, a)`, `[a, b)`, ... `[z, num_blocks)` one
        after the other gives the values the DiT's own block loop gives (its output: `image`)."""
        ...


class SequentialBlocks:
    """A `BlockRange` for DiTs whose blocks run one after another on (image, text) streams.

    `row_inputs(rows)` gives the per-row inputs the blocks read (timestep modulation, cross-attention
    context, masks) for batch rows `rows` (None: all), once per range; `call(i, image, text, inputs)` runs
    block i and returns (image, text) (text None where the DiT keeps no text stream, or after a last
    block that drops it)."""

    def __init__(
        self,
        num_blocks: int,
        x: torch.Tensor,
        ctx: torch.Tensor | None,
        row_inputs: Callable[[torch.Tensor | None], Any],
        call: Callable[
            [int, torch.Tensor, torch.Tensor | None, Any], tuple[torch.Tensor, torch.Tensor | None]
        ],
    ) -> None:
        self._num_blocks, self.x, self.ctx = num_blocks, x, ctx
        self.row_inputs, self.call = row_inputs, call

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def start(self) -> Streams:
        return Streams(self.x, self.ctx)

    def run(self, streams: Streams, rows: torch.Tensor | None, start: int, stop: int) -> Streams:
        inputs = self.row_inputs(rows)
        x, ctx = streams.image, streams.text
        for i in range(start, stop):
            x, ctx = self.call(i, x, ctx, inputs)
        return Streams(x, ctx)


def refuse_sequence_parallel(split: object, family: str) -> None:
    """RuntimeError when the DiT's sequence is split over ranks: block-range methods do not run there yet."""
    if split is not None:
        raise RuntimeError(
            f"cache methods that run {family}'s blocks in ranges (dbcache) do not support sequence "
            "parallelism yet; use a whole-span method (teacache, magcache, taylorseer, scm)"
        )
