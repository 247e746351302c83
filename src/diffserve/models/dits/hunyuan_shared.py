"""How the Hunyuan joint DiTs (HunyuanVideo 1.0, HunyuanVideo 1.5, HunyuanImage 2.1) run their blocks.

Every block of these DiTs, double- or single-stream, maps the (image or video, context) streams to new
ones and reads the same per-forward inputs (`JointBlockInputs`): SiLU(temb), the RoPE tables of the
image/video tokens, the joint key mask and, for HunyuanVideo's "token_replace" blocks, the first frame's
own temb. Here are the ways a DiT runs a list of such blocks: all in turn on one device, over the
sequence-parallel ranks (the image/video tokens and the context tokens two split streams), and as a
`SequentialBlocks` range for DBCache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from diffserve.distributed.sequence_split import SequenceSplit, sequence_split
from diffserve.layers.rotary import RopeTables
from diffserve.models.cache_methods.blocks import SequentialBlocks
from diffserve.models.step_cache import take_rows


class FirstFrame(NamedTuple):
    """The first frame's share of the video tokens and its own SiLU(temb)."""

    tokens: int  # the leading video tokens that form the first latent frame (height' * width')
    temb_act: torch.Tensor  # (batch, inner): SiLU of the timestep-0 temb


class JointBlockInputs(NamedTuple):
    """What every block reads besides its two streams, the same for all blocks of one forward."""

    temb_act: torch.Tensor  # (batch, inner): SiLU(temb)
    rope: RopeTables  # half-width (cos, sin) tables of the image/video tokens
    key_mask: torch.Tensor | None  # (batch, 1, 1, image + ctx) bool, true for keys attended; None: all
    first: FirstFrame | None = None  # token_replace's first frame; None for the plain blocks

    def take(self, rows: torch.Tensor | None) -> JointBlockInputs:
        """These inputs for batch rows `rows` (None: all); the RoPE tables are per token, not per row."""
        first = self.first
        return JointBlockInputs(
            take_rows(self.temb_act, rows),
            self.rope,
            None if self.key_mask is None else take_rows(self.key_mask, rows),
            None if first is None else first._replace(temb_act=take_rows(first.temb_act, rows)),
        )


def joint_key_mask(context_mask: torch.Tensor | None, image_len: int) -> torch.Tensor | None:
    """The (batch, 1, 1, image + ctx) key mask of [image; context] from the context's (batch, ctx) mask:
    every image/video token is a key; None when the context has no masked token (`context_mask` None)."""
    if context_mask is None:
        return None
    image_keys = context_mask.new_ones(context_mask.shape[0], image_len)
    return torch.cat([image_keys, context_mask], dim=1)[:, None, None, :]


def run_blocks(
    blocks: Iterable[nn.Module], x: torch.Tensor, ctx: torch.Tensor, inputs: JointBlockInputs
) -> torch.Tensor:
    """Every block in turn on (image/video, context); the image/video tokens the output head reads."""
    for block in blocks:
        x, ctx = block(x, ctx, inputs)
    return x


def run_blocks_split(
    blocks: Iterable[nn.Module], x: torch.Tensor, ctx: torch.Tensor, inputs: JointBlockInputs
) -> torch.Tensor:
    """`run_blocks`, over the sequence-parallel ranks in scope when there are several.

    The image/video (stream 0) and context (stream 1) tokens are split over the ranks. The blocks
    concatenate [image; context] locally in the order of the split's streams, so the scope's joint key
    mask (the shards' padding, the context part of `inputs.key_mask`) lines up with their keys; they get
    no key mask of their own. The RoPE tables cover the image/video tokens only and are cut like them;
    the first frame keeps the first-frame tokens of the local shard. The image/video tokens are gathered
    back at the end."""
    split = sequence_split([x.shape[1], ctx.shape[1]])
    if split is None:
        return run_blocks(blocks, x, ctx, inputs)
    image, context = 0, 1
    key_mask, first = inputs.key_mask, inputs.first
    text_mask = None if key_mask is None else key_mask[:, 0, 0, x.shape[1] :]
    rope = tuple(split.split(image, table, dim=0) for table in inputs.rope)
    first = None if first is None else _local_first_frame(split, first)
    x, ctx = split.split(image, x), split.split(context, ctx)
    with split.attention_scope(x.shape[0], x.device, [None, text_mask]):
        x = run_blocks(blocks, x, ctx, JointBlockInputs(inputs.temb_act, rope, None, first))
    return split.gather(image, x)


def block_range(
    blocks: Sequence[nn.Module], x: torch.Tensor, ctx: torch.Tensor, inputs: JointBlockInputs
) -> SequentialBlocks:
    """The blocks as one `BlockRange` for DBCache, in the order given, on (image/video, context) streams
    that every block updates; each range reads `inputs` of its rows."""

    def call(
        i: int, x: torch.Tensor, ctx: torch.Tensor | None, rows_inputs: JointBlockInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return blocks[i](x, ctx, rows_inputs)

    return SequentialBlocks(len(blocks), x, ctx, inputs.take, call)


def _local_first_frame(split: SequenceSplit, first: FirstFrame) -> FirstFrame:
    """`first` on this rank's video shard: the first frame is the leading `first.tokens` video tokens, so
    the shard's own first-frame tokens lead it too; their count is its overlap with them (0 past them)."""
    shard = split.shards[0]
    return first._replace(tokens=max(0, min(shard.shard_len, first.tokens - shard.start)))
