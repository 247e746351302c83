"""`KeyPlan`: where each Diffusers-named DiT tensor comes from in a single-file checkpoint.

Original checkpoints (BFL's FLUX, Stability's SD3, Wan's, Z-Image's) name tensors their own way and
fuse some that Diffusers keeps apart (FLUX's `qkv`, its single blocks' `linear1`); the final AdaLN of
FLUX and SD3 stores (shift, scale) where Diffusers stores (scale, shift). A plan maps every Diffusers
name to one `Piece`: a file tensor, optionally a range of its rows, optionally with its two halves
swapped. Plans are built from the file's names and shapes alone (no tensor is read), so a checkpoint
is validated against the model before anything is loaded, and each file tensor is then read once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: File tensor name -> shape (as the file's header gives it, after any dequantization).
Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class Piece:
    """One Diffusers tensor's origin: file tensor `source`, rows `rows` = [start, stop) of its first
    dimension (None: all of it), the two halves of dim 0 swapped when `swap_halves`."""

    source: str
    rows: tuple[int, int] | None = None
    swap_halves: bool = False

    def shape(self, source_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this piece has when its source has `source_shape`."""
        if self.rows is None:
            return source_shape
        return (self.rows[1] - self.rows[0], *source_shape[1:])

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of the (already read) source `tensor`."""
        if self.rows is not None:
            tensor = tensor[self.rows[0] : self.rows[1]]
        if self.swap_halves:
            first, second = tensor.chunk(2, dim=0)
            tensor = torch.cat([second, first], dim=0)
        return tensor


#: Diffusers name -> its piece of the file.
KeyPlan = dict[str, Piece]


def identity_plan(shapes: Shapes) -> KeyPlan:
    """The plan of a file already in Diffusers' names: every tensor as it is."""
    return {name: Piece(name) for name in shapes}


def add_param_pair(plan: KeyPlan, target: str, source: str, swap_halves: bool = False) -> None:
    """`target.weight` / `target.bias` from `source.weight` / `source.bias` (a Linear, or a norm)."""
    for param in ("weight", "bias"):
        plan[f"{target}.{param}"] = Piece(f"{source}.{param}", swap_halves=swap_halves)


def add_row_split(
    plan: KeyPlan, shapes: Shapes, targets: Sequence[str], source: str, sizes: Sequence[int] | None = None
) -> None:
    """Modules `targets` (their weight and, where the file has one, bias) from consecutive row ranges
    of module `source`: `sizes` rows each, or equal parts when None. An absent source still gets
    (empty) pieces, so validation reports it as missing."""
    weight_rows = shapes.get(f"{source}.weight", (0,))[0]
    if sizes is None:
        sizes = [weight_rows // len(targets)] * len(targets)
    params = ["weight"] + (["bias"] if f"{source}.bias" in shapes else [])
    start = 0
    for target, size in zip(targets, sizes, strict=True):
        for param in params:
            plan[f"{target}.{param}"] = Piece(f"{source}.{param}", rows=(start, start + size))
        start += size


def layer_indices(shapes: Shapes, prefix: str) -> list[int]:
    """The block indices `n` of names `prefix` + `n.` + ..., sorted."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for name in shapes if (m := pattern.match(name))})


def renamed_plan(shapes: Shapes, renames: Sequence[tuple[str, str]]) -> KeyPlan:
    """A plan that only renames: each file name gets `renames` applied in order as substring
    replacements (the convention of Diffusers' single-file converters)."""
    plan: KeyPlan = {}
    for name in shapes:
        target = name
        for old, new in renames:
            target = target.replace(old, new)
        plan[target] = Piece(name)
    return plan
