"""The channel layout of one half of a VAE (its encoder or its decoder), passed as one argument.

Every video VAE's encoder and decoder is built from the same four numbers: the channels into `conv_in`,
the channels out of `conv_out`, the width of each level and the resnets per level. A family adds its own
knobs (norm groups, compression ratios, ...) in a frozen subclass, so that its encoder and decoder each
take one layout instead of repeating a long parameter list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CoderLayout:
    """`in_channels` into the half's `conv_in`, `out_channels` out of its `conv_out`, `block_out_channels`
    the width of each level (in the order the family's half documents) and `layers_per_block` resnets a
    level (decoders add their one extra resnet themselves)."""

    in_channels: int
    out_channels: int
    block_out_channels: Sequence[int]
    layers_per_block: int
