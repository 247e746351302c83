"""FLUX's last single-stream block computes the image rows only (`text_len`): same values, less work."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffserve.layers.rotary import multi_axis_rope_tables
from diffserve.models.dits.flux import FluxSingleTransformerBlock

DIM, HEADS, HEAD_DIM = 16, 2, 8
TEXT_LEN, IMAGE_LEN = 12, 5


def _block(fused: bool) -> FluxSingleTransformerBlock:
    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(DIM, HEADS, HEAD_DIM).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    if fused:
        block.fuse_projections()
    return block


def _inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(batch, TEXT_LEN + IMAGE_LEN, DIM, generator=g)
    emb = torch.randn(batch, 3 * DIM, generator=g)
    # Text positions distinct from zero too, so a query rotated with the wrong rows would show.
    ids = torch.randint(0, 7, (TEXT_LEN + IMAGE_LEN, 3), generator=g).float()
    return h, emb, multi_axis_rope_tables(ids, (2, 2, 4))


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("batch", [1, 2])
def test_last_block_returns_the_full_blocks_image_rows(fused: bool, batch: int) -> None:
    block = _block(fused)
    h, emb, rope = _inputs(batch)
    with torch.inference_mode():
        full = block(h, emb, rope)
        image_only = block(h, emb, rope, text_len=TEXT_LEN)
    assert image_only.shape == (batch, IMAGE_LEN, DIM)
    torch.testing.assert_close(image_only, full[:, TEXT_LEN:], rtol=1e-6, atol=1e-6)


def test_last_block_skips_the_text_rows_queries_mlp_and_output_projection() -> None:
    """Text rows cost only their keys and values: the matmul FLOPs drop by exactly the skipped work."""
    block = _block(fused=True)
    h, emb, rope = _inputs(1)
    counts = {}
    for name, text_len in (("full", None), ("image_only", TEXT_LEN)):
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            block(h, emb, rope, text_len=text_len)
        counts[name] = counter.get_flop_counts()["Global"]
    inner, mlp = HEADS * HEAD_DIM, 4 * DIM
    linear_flops = lambda rows, width_out, width_in: 2 * rows * width_out * width_in  # noqa: E731
    skipped = linear_flops(TEXT_LEN, inner + mlp, DIM) + linear_flops(TEXT_LEN, DIM, inner + mlp)
    full_mm = sum(v for k, v in counts["full"].items() if k in (torch.ops.aten.addmm, torch.ops.aten.mm))
    trimmed_mm = sum(
        v for k, v in counts["image_only"].items() if k in (torch.ops.aten.addmm, torch.ops.aten.mm)
    )
    assert full_mm - trimmed_mm == skipped
