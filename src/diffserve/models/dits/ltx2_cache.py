"""LTX-2's blocks for the cache methods (`models/step_cache.py`): two output streams, video and audio.

Every LTX-2 block updates both streams and the output heads read both, so what a cache method caches and
reuses is the residual of both: the two are packed into one hidden state per row,
`[video tokens flattened; audio tokens flattened]` (`pack` / `unpack`: copies, no arithmetic), which is
what the batch sees as the blocks' input and output. A reused residual therefore restores both streams,
a DBCache probe (the first blocks' output residual) and a MagCache ratio measure both (cache-dit caches
the audio as its second stream and probes the video alone), and TeaCache watches the first block's
modulated video input (`LTX2VideoTransformerBlock.modulated_video_input`).

The rows of one request are its positive, negative and STG rows, which decide together; each row keeps
its own residual (an STG row's is its perturbed one). The STG perturbation and every other per-row input
are sliced to the rows that compute (`BlockConditioning.for_rows`). The modality-isolation rows run their
own forward each step, without a cache (`families/ltx2/pipeline.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.dits.ltx2_blocks import NO_PERTURBATION, BlockConditioning, Perturbation


def pack(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Video (rows, Tv, D) and audio (rows, Ta, Da) tokens as one (rows, Tv * D + Ta * Da) hidden state."""
    if x.dtype != a.dtype:
        raise ValueError(f"the cache packs video and audio together: both {x.dtype}, got audio {a.dtype}")
    return torch.cat([x.flatten(1), a.flatten(1)], dim=1)


def unpack(
    h: torch.Tensor, video_shape: torch.Size, audio_shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s inverse for rows of these (tokens, width) shapes (the first dimension is h's rows)."""
    split = video_shape[1] * video_shape[2]
    x = h[:, :split].reshape(h.shape[0], *video_shape[1:])
    a = h[:, split:].reshape(h.shape[0], *audio_shape[1:])
    return x, a


class LTX2Blocks:
    """One forward's blocks over packed rows: the whole span for any rows (`run_whole`, the whole-span
    methods) and, as a `BlockRange`, any range of blocks (DBCache)."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        x: torch.Tensor,
        a: torch.Tensor,
        cond: BlockConditioning,
        stg_blocks: set[int],
        perturbation: Perturbation,
    ) -> None:
        self.blocks = list(blocks)
        self.video_shape, self.audio_shape = x.shape, a.shape
        self.packed = pack(x, a)
        self.cond, self.stg_blocks, self.perturbation = cond, stg_blocks, perturbation

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def start(self) -> Streams:
        return Streams(self.packed)

    def run(self, streams: Streams, rows: torch.Tensor | None, start: int, stop: int) -> Streams:
        cond = self.cond if rows is None else self.cond.for_rows(rows)
        perturbation = self.perturbation if rows is None else self.perturbation.for_rows(rows)
        x, a = unpack(streams.image, self.video_shape, self.audio_shape)
        for index in range(start, stop):
            x, a = self.blocks[index](
                x, a, cond, perturbation if index in self.stg_blocks else NO_PERTURBATION
            )
        return Streams(pack(x, a))

    def run_whole(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Every block for batch rows `rows` (None: all), packed."""
        h = self.packed if rows is None else self.packed.index_select(0, rows)
        return self.run(Streams(h), rows, 0, self.num_blocks).image
