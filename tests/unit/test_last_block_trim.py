"""A DiT's last block computes only what the output head reads: same values, less work.

FLUX's last single-stream block returns the image rows only (`text_len`); Qwen-Image's last
double-stream block skips its text stream's output (`text_out=False`); Z-Image's last main layer
computes the leading image positions only (`keep_rows`); SD3's last joint block (`context_pre_only`)
queries the image rows only.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffserve.layers.rotary import multi_axis_rope_tables
from diffserve.models.dits.flux import FluxSingleTransformerBlock
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel, QwenImageTransformerConfig
from diffserve.models.dits.sd3 import SD3Transformer2DModel, SD3TransformerConfig
from diffserve.models.dits.z_image import ZImageTransformer2DModel, ZImageTransformerConfig

DIM, HEADS, HEAD_DIM = 16, 2, 8
TEXT_LEN, IMAGE_LEN = 12, 5


def _random_weights(module: torch.nn.Module, scale: float) -> None:
    """Every parameter drawn from N(0, scale^2), so no term of the block is trivially zero or one."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)


def _block(fused: bool) -> FluxSingleTransformerBlock:
    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(DIM, HEADS, HEAD_DIM).eval()
    _random_weights(block, 0.2)
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
    _, full_mm = _matmul_flops(lambda: block(h, emb, rope))
    _, trimmed_mm = _matmul_flops(lambda: block(h, emb, rope, text_len=TEXT_LEN))
    inner, mlp = HEADS * HEAD_DIM, 4 * DIM
    linear_flops = lambda rows, width_out, width_in: 2 * rows * width_out * width_in  # noqa: E731
    skipped = linear_flops(TEXT_LEN, inner + mlp, DIM) + linear_flops(TEXT_LEN, DIM, inner + mlp)
    assert full_mm - trimmed_mm == skipped


def _matmul_flops(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """`run()`'s output and the FLOPs of its matmuls (linear layers; a linear layer on a strided 3-d
    view, as Diffusers' SD3 attention projects, runs as a `bmm`)."""
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        out = run()
    counts = counter.get_flop_counts()["Global"]
    matmuls = (torch.ops.aten.addmm, torch.ops.aten.mm, torch.ops.aten.bmm)
    return out, sum(v for k, v in counts.items() if k in matmuls)


def test_qwen_image_last_block_skips_the_text_output_with_the_same_image() -> None:
    torch.manual_seed(0)
    dim, text_len, layers = 32, 9, 3
    model = QwenImageTransformer2DModel(QwenImageTransformerConfig(
        patch_size=2, in_channels=16, out_channels=4, num_layers=layers, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
    )).eval()  # fmt: skip
    _random_weights(model, 0.1)
    g = torch.Generator().manual_seed(2)
    inputs = {
        "hidden_states": torch.randn(2, 12, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, text_len, 24, generator=g),
        "encoder_hidden_states_mask": None,
        "timestep": torch.tensor([0.3, 0.8]),
        "img_shapes": [[(1, 4, 3)]] * 2,
    }
    trimmed, trimmed_flops = _matmul_flops(lambda: model(**inputs))

    def every_block_updates_the_text(x, ctx, temb_act, rope, attn_mask, cond_tokens, controls=None):
        for block in model.transformer_blocks:
            ctx, x = block(x, ctx, temb_act, rope, attn_mask, cond_tokens)
        return x

    model._run_blocks = every_block_updates_the_text
    full, full_flops = _matmul_flops(lambda: model(**inputs))
    torch.testing.assert_close(trimmed, full, rtol=0, atol=0)
    # Skipped per text row of the last block: to_add_out (dim x dim) and the MLP (dim -> 4 dim -> dim).
    assert full_flops - trimmed_flops == 2 * 2 * text_len * (dim * dim + 2 * dim * 4 * dim)


def test_z_image_last_layer_computes_the_image_positions_only_with_the_same_output() -> None:
    """Two samples with different image sizes and caption lengths (masked batch, mixed padding)."""
    torch.manual_seed(0)
    dim = 64
    model = ZImageTransformer2DModel(ZImageTransformerConfig(
        in_channels=16, dim=dim, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
        cap_feat_dim=32, axes_dims=(8, 12, 12), axes_lens=(256, 64, 64),
    )).eval()  # fmt: skip
    _random_weights(model, 0.1)
    g = torch.Generator().manual_seed(3)
    inputs = {
        "x": [torch.randn(16, 1, h, w, generator=g) for h, w in ((8, 8), (8, 12))],
        "t": torch.tensor([0.3, 0.7]),
        "cap_feats": [torch.randn(n, 32, generator=g) for n in (40, 9)],
    }
    trimmed, trimmed_flops = _matmul_flops(lambda: torch.cat([o.flatten() for o in model(**inputs)]))

    last = model.layers[-1]
    every_position = last.forward

    def last_layer_on_every_position(h, cis, mask, adaln, keep_rows=None):  # noqa: ANN001, ANN202
        return every_position(h, cis, mask, adaln)[:, :keep_rows]

    last.forward = last_layer_on_every_position
    full, full_flops = _matmul_flops(lambda: torch.cat([o.flatten() for o in model(**inputs)]))
    torch.testing.assert_close(trimmed, full, rtol=1e-6, atol=1e-6)
    # Image tokens (2x2 patches) pad to 32 in both samples; captions pad to 64 and 32, so the batch's
    # unified sequence is 32 + 64 = 96 positions per row, of which the last layer keeps the first 32.
    # Skipped per dropped position: to_q and to_out (dim x dim each) and the SwiGLU MLP (3 x dim x hidden).
    hidden = int(dim / 3 * 8)
    dropped = 2 * (96 - 32)
    assert full_flops - trimmed_flops == 2 * dropped * (2 * dim * dim + 3 * dim * hidden)


@pytest.mark.parametrize("batch", [1, 2])
def test_sd3_last_block_queries_the_image_rows_only_with_diffusers_output(batch: int) -> None:
    """Diffusers computes the last block's text queries and drops their output; diffserve skips them.

    SDPA treats query rows independently, so at batch 1 the output is bit-identical, with a text longer
    than the image (as SD3's 333 tokens at 256x256). At batch 2 diffserve also projects contiguous
    attention halves where Diffusers projects strided views (`SD3JointAttention`): rounding only.
    """
    from diffusers import SD3Transformer2DModel as DiffusersSD3

    config = {
        "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 12, "caption_projection_dim": 16,
        "pooled_projection_dim": 10, "out_channels": 4, "pos_embed_max_size": 8,
        "dual_attention_layers": (0,), "qk_norm": "rms_norm",
    }  # fmt: skip
    torch.manual_seed(0)
    ref = DiffusersSD3(**config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = SD3Transformer2DModel(SD3TransformerConfig(**config)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    text_len, height, width = 40, 8, 6
    g = torch.Generator().manual_seed(4)
    inputs = {
        "hidden_states": torch.randn(batch, 4, height, width, generator=g),
        "encoder_hidden_states": torch.randn(batch, text_len, 12, generator=g),
        "pooled_projections": torch.randn(batch, 10, generator=g),
        "timestep": torch.tensor([900.0, 30.0][:batch]),
    }
    with torch.inference_mode():
        expected = ref(**inputs, return_dict=False)[0]
    trimmed, trimmed_flops = _matmul_flops(lambda: ours(**inputs))
    tolerance = 0 if batch == 1 else 1e-6
    torch.testing.assert_close(trimmed, expected, rtol=tolerance, atol=tolerance)

    last = ours.transformer_blocks[-1].attn
    last.to_add_out = torch.nn.Identity()  # makes the attention compute (and discard) the text rows too
    _, full_flops = _matmul_flops(lambda: ours(**inputs))
    # Skipped: the text queries' projection (`add_q_proj`, inner x dim per text row).
    assert full_flops - trimmed_flops == 2 * batch * text_len * 16 * 16
