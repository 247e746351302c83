"""Native Qwen-Image 2.1 DiT with condition images against Diffusers' `QwenImage21Transformer2DModel`:
two condition images of different (non-square) grids in the text's vision slots, with text before,
between and after them, two samples at different timesteps; a row with condition images batched with a
text-only row of another length gives what each gives alone; other condition latents move the output."""

from __future__ import annotations

import pytest
import torch
from qwen_image21_dit_cases import (
    GRID,
    MIN_DB,
    TINY,
    assert_moved,
    target_prediction,
    text_only_prediction,
)

from diffserve.models.dits.qwen_image21 import ConditionBlock, QwenImage21Transformer2DModel
from diffserve.testing.parity import assert_parity, parity_pair

diffusers = pytest.importorskip("diffusers")

#: Condition images' latent grids and where their slots start in the text; 15 text states in all.
COND_GRIDS = [(2, 4), (4, 2)]
SLOTS_AT = [3, 7]
TEXT_LEN = 15


def _layout(g: torch.Generator, batch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Text states and each condition image's latents, for `batch` samples."""
    text = torch.randn(batch, TEXT_LEN, 24, generator=g)
    return text, [torch.randn(batch, h * w, 8, generator=g) for h, w in COND_GRIDS]


def _blocks(latents: list[torch.Tensor], row: int) -> list[ConditionBlock]:
    return [
        ConditionBlock(slot=at, slots=h * w // 4, latents=lat[row], grid=(h, w))
        for at, (h, w), lat in zip(SLOTS_AT, COND_GRIDS, latents, strict=True)
    ]


def _reference(reference, x, text, latents, t) -> torch.Tensor:
    """Diffusers: vision slots marked in `img_mask`, condition latents first, then the target's."""
    batch = x.shape[0]
    h, w = GRID
    slots = torch.zeros(batch, TEXT_LEN + h * w // 4, dtype=torch.bool)
    for at, (ch, cw) in zip(SLOTS_AT, COND_GRIDS, strict=True):
        slots[:, at : at + ch * cw // 4] = True
    slots[:, TEXT_LEN:] = True
    img_shapes = [[*((1, ch, cw) for ch, cw in COND_GRIDS), (1, h, w)]] * batch
    return target_prediction(reference, torch.cat([*latents, x], 1), text, t, img_shapes, slots)


@pytest.fixture(scope="module")
def pair():
    return parity_pair(diffusers.QwenImage21Transformer2DModel, QwenImage21Transformer2DModel, TINY)


def test_condition_images_match(pair) -> None:
    reference, native = pair
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, GRID[0] * GRID[1], 8, generator=g)
    text, latents = _layout(g, 2)
    t = torch.tensor([0.2, 0.9])
    with torch.no_grad():
        want = _reference(reference, x, text, latents, t)
        got = native(x, text, [TEXT_LEN] * 2, t, GRID, conditions=[_blocks(latents, 0), _blocks(latents, 1)])
        moved = [torch.randn_like(lat) for lat in latents]
        other = native(x, text, [TEXT_LEN] * 2, t, GRID, conditions=[_blocks(moved, 0), _blocks(moved, 1)])
    assert_parity(got, want, "qwen-image-2.1 dit, two condition images", min_db=MIN_DB)
    assert_moved(other, want, "the condition images are unused")


def test_conditioned_row_batched_with_text_only_row(pair) -> None:
    reference, native = pair
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, GRID[0] * GRID[1], 8, generator=g)
    text, latents = _layout(g, 1)
    plain = torch.randn(1, 6, 24, generator=g)
    padded = torch.cat([text, torch.nn.functional.pad(plain, (0, 0, 0, TEXT_LEN - 6))])
    t = torch.tensor([0.4, 0.7])
    with torch.no_grad():
        got = native(x, padded, [TEXT_LEN, 6], t, GRID, conditions=[_blocks(latents, 0), []])
        want_cond = _reference(reference, x[:1], text, latents, t[:1])
        want_plain = text_only_prediction(reference, x[1:], plain, t[1:])
    assert_parity(got[:1], want_cond, "conditioned row in a mixed batch", min_db=MIN_DB)
    assert_parity(got[1:], want_plain, "text-only row in a mixed batch", min_db=MIN_DB)
