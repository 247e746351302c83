"""Z-Image's blocks as one ordered sequence runnable in ranges (`models/cache_methods/blocks.BlockRange`):
the noise refiner (image tokens only), then the main layers (one unified [image; caption] sequence per
sample), as the whole-span cache methods count them. DBCache's Fn and Bn count the main layers only, as
cache-dit's Z-Image adapter does (`CacheRule.range_offset`): the noise refiner always runs.

Between two blocks the state is `Streams` in one form for both parts: `image` (batch, image width, dim),
each sample's padded image tokens, and `text` (batch, caption width, dim), each sample's refined caption.
In the refiner part the caption is what the context refiner made of it (the noise refiner does not read
it); a range of main layers joins the two into the unified sequence at its start (the model's own gather)
and splits it back at its end (copies, no arithmetic), so a residual or a probe is always taken on image
tokens, and the image stream at the range's start and end is what the model's own block loop starts from
and returns. Positions past a sample's own tokens (batch padding) hold zeros at every cut: attention
masks them as keys and nothing reads them, so the values the rows get do not depend on the padding.

Rows run with the layout of their own samples (masks, RoPE tables and caption width of those rows only),
as `ZImageTransformer2DModel._run_blocks_for_rows` runs them, and are padded back to the batch's widths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.distributed.sequence_split import sequence_split
from diffserve.models.cache_methods.blocks import Streams

if TYPE_CHECKING:
    from diffserve.models.dits.z_image import _Layout


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ZImageBlockRange:
    """One forward's noise-refiner and main blocks. `layout_for(rows)` gives the layout of batch rows
    `rows` alone (None: the whole batch's), `adaln` the per-row (or shared) timestep embedding."""

    def __init__(
        self,
        noise_refiner: Sequence[nn.Module],
        layers: Sequence[nn.Module],
        img: torch.Tensor,
        cap: torch.Tensor,
        adaln: torch.Tensor,
        layout_for: Callable[[torch.Tensor | None], _Layout],
        seq_multiple: int,
    ) -> None:
        if sequence_split([img.shape[1]]) is not None:
            raise RuntimeError(
                "cache methods that run Z-Image's blocks in ranges (dbcache) do not support sequence "
                "parallelism yet; use a whole-span method (teacache, magcache, taylorseer, scm)"
            )
        self.noise_refiner, self.layers = list(noise_refiner), list(layers)
        self.img, self.cap, self.adaln = img, cap, adaln
        self.layout_for = layout_for
        self.seq_multiple = seq_multiple

    @property
    def num_blocks(self) -> int:
        return len(self.noise_refiner) + len(self.layers)

    def start(self) -> Streams:
        return Streams(self.img, self.cap)

    def run(self, streams: Streams, rows: torch.Tensor | None, start: int, stop: int) -> Streams:
        layout = self.layout_for(rows)
        adaln = self.adaln if rows is None or self.adaln.shape[0] == 1 else self.adaln.index_select(0, rows)
        image, text = streams.image, streams.text
        if text is None:
            raise RuntimeError("Z-Image's blocks read the caption stream, which the range was not given")
        image_width, text_width = image.shape[1], text.shape[1]
        # The rows' own widths: their image and caption tokens all lie within them.
        image = image[:, : layout.x_cis.shape[1]]
        text = text[:, : layout.caption_width]
        refiners = len(self.noise_refiner)
        for i in range(start, min(stop, refiners)):
            image = self.noise_refiner[i](image, layout.x_cis, layout.x_mask, adaln)
        if stop > refiners:
            image, text = self._main(
                image, text, adaln, layout, max(start, refiners) - refiners, stop - refiners
            )
        image = F.pad(self._zero_padding(image, layout), (0, 0, 0, image_width - image.shape[1]))
        if text is not None:
            text = F.pad(text, (0, 0, 0, text_width - text.shape[1]))
        return Streams(image, text)

    def _main(
        self, image: torch.Tensor, text: torch.Tensor, adaln: torch.Tensor, layout: _Layout, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Main layers `[lo, hi)` on the split streams: joined into the unified sequence, run, split back;
        after the model's last layer only the image stream is left (it queries the image rows only)."""
        zero = image.new_zeros(1, image.shape[-1])
        h = torch.cat([image.flatten(0, 1), text.flatten(0, 1), zero])[layout.unified_index]
        for j in range(lo, hi):
            keep = image.shape[1] if j == len(self.layers) - 1 else None
            h = self.layers[j](h, layout.unified_cis, layout.unified_mask, adaln, keep_rows=keep)
        if hi == len(self.layers):
            return h, None
        image_index, text_index = self._split_index(layout, image.shape[1], text.shape[1], h.shape[1])
        flat = torch.cat([h.flatten(0, 1), zero])
        return flat[image_index], flat[text_index]

    def _split_index(
        self, layout: _Layout, image_width: int, text_width: int, unified_width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather indices from [unified rows of all samples; zero row] back to the two streams: sample i's
        padded image tokens lead its unified row, its padded caption follows; the rest is the zero row."""
        batch = len(layout.sizes)
        zero_row = batch * unified_width
        image_index = torch.full((batch, image_width), zero_row, dtype=torch.long)
        text_index = torch.full((batch, text_width), zero_row, dtype=torch.long)
        for i, (tokens, caption) in enumerate(zip(layout.image_tokens, layout.caption_lengths, strict=True)):
            a, b = _round_up(tokens, self.seq_multiple), _round_up(caption, self.seq_multiple)
            image_index[i, :a] = torch.arange(i * unified_width, i * unified_width + a)
            text_index[i, :b] = torch.arange(i * unified_width + a, i * unified_width + a + b)
        device = layout.unified_index.device
        return image_index.to(device), text_index.to(device)

    def _zero_padding(self, h: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """The image stream with the positions past each sample's own padded image tokens zeroed: batch
        padding, which attention masks and the output head never reads; zero keeps a residual or a probe
        free of the batch around it. Unchanged (no copy) when every sample fills the width."""
        padded = [_round_up(n, self.seq_multiple) for n in layout.image_tokens]
        if all(n >= h.shape[1] for n in padded):
            return h
        valid = (
            torch.arange(h.shape[1], device=h.device)[None, :]
            < torch.tensor(padded, device=h.device)[:, None]
        )
        return h * valid[..., None].to(h.dtype)
