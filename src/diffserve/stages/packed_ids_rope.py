"""RoPE tables per request shape for the denoisers of DiTs positioned by packed-token ids (text ids, then
image ids on the packed latent grid), whose ids are a pure function of the request's shape: the text ids
are zeros and the image ids the packed grid, so (text length, latent grid, dtype) on the ids' device
identifies the tables, and each shape's are computed once rather than once per step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from diffserve.layers.rotary import RopeTables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.request import Req


class PackedIdsRopeModel(Protocol):
    """A DiT that builds its RoPE tables from text and image position ids."""

    def rope_tables(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> RopeTables: ...


def packed_ids_rope(
    cache: BoundedCache[RopeTables],
    transformer: PackedIdsRopeModel,
    req: Req,
    text_ids: torch.Tensor | None,
    image_ids: torch.Tensor | None,
) -> RopeTables:
    """`req`'s RoPE tables from `cache`, built by `transformer` from its ids on first use of its shape."""
    assert text_ids is not None and image_ids is not None
    key = (text_ids.shape[0], req.latent_size, image_ids.dtype)
    return cache.get_or_build(key, image_ids.device, lambda: transformer.rope_tables(text_ids, image_ids))
