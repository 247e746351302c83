"""`GGUFLinear` (layers/gguf_linear.py): GGUF Q8_0 / Q4_K blocks kept as stored, dequantized per layer.

- The torch dequantizers give exactly gguf-py's reference values, for blocks written by a quantizer and
  for random block bytes (every scale and nibble pattern).
- The layer's product equals `F.linear` by the dequantized weight: whole, in cache-sized row chunks,
  for a range of output rows, in bfloat16; it holds the blocks' bytes, keeps them uint8 across moves.
- Malformed blocks are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffserve.layers.gguf_linear import (
    DEQUANTIZERS,
    GGUF_BLOCKS,
    GGUFLinear,
    blockwise_linear,
    quantized_layer_kinds,
)
from diffserve.layers.quantized_linear import linear_rows
from diffserve.platforms.cpu import CpuPlatform
from diffserve.testing.tiny_single_file import quantize_array

gguf = pytest.importorskip("gguf", reason="gguf-py is the reference dequantizer")


def _reference(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).copy())


def _random_blocks(rows: int, in_features: int, qtype: str, seed: int) -> np.ndarray:
    """Random block bytes with finite fp16 scales (a NaN or inf scale is no real file's)."""
    block, block_bytes = GGUF_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, in_features // block, block_bytes), dtype=np.uint8)
    fp16_fields = 2 if qtype == "Q4_K" else 1  # Q4_K: d and dmin; Q8_0: d
    scales = rng.uniform(-0.05, 0.05, size=(rows, in_features // block, fp16_fields)).astype(np.float16)
    raw[..., : 2 * fp16_fields] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
def test_dequantizers_equal_gguf_py(qtype) -> None:
    weights = torch.randn(48, 512, generator=torch.Generator().manual_seed(0)).numpy()
    for blocks in (quantize_array(weights, qtype), _random_blocks(48, 512, qtype, seed=1)):
        ours = DEQUANTIZERS[qtype](torch.from_numpy(np.ascontiguousarray(blocks)), torch.float32)
        assert ours.shape == (48, 512)
        assert torch.equal(ours, _reference(blocks, qtype).reshape(48, 512))
    # A row range of the blocks (a fused layer's part) is those rows of the weight.
    packed = torch.from_numpy(np.ascontiguousarray(blocks))
    assert torch.equal(DEQUANTIZERS[qtype](packed[5:17], torch.float32), ours[5:17])


#: Chunked products add the 512 terms of each output (values of order 20) in another order than one F.linear:
#: a few fp32 ulps of the output's scale (1.6e-5 seen on a loaded machine, where the kernel blocks differ).
SUM_ORDER_ATOL = 1e-4


def _layer(qtype: str, out_features: int = 40, in_features: int = 512, bias: bool = True) -> GGUFLinear:
    weights = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(2)).numpy()
    blocks = torch.from_numpy(np.ascontiguousarray(quantize_array(weights, qtype)))
    b = torch.randn(out_features, generator=torch.Generator().manual_seed(3)) if bias else None
    return GGUFLinear(blocks, qtype, in_features, b)


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
def test_product_equals_linear_by_the_dequantized_weight(qtype) -> None:
    layer = _layer(qtype)
    weight = layer.dequantized_weight()
    x = torch.randn(2, 7, 512, generator=torch.Generator().manual_seed(4))
    expected = F.linear(x, weight, layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), expected)  # not bound: one F.linear by the whole weight
        layer.bind_platform(CpuPlatform())
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=SUM_ORDER_ATOL)
        packed = layer.weight
        chunked = blockwise_linear(  # 6 rows a chunk: 7 chunks
            x, 40, lambda a, b: layer.dequantized_weight(rows=slice(a, b)), layer.bias, 512 * 6
        )
        torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=SUM_ORDER_ATOL)
        assert torch.equal(layer._weight(packed, torch.float32, 512 * 6), weight)
        rows = slice(8, 24)
        torch.testing.assert_close(
            linear_rows(layer, x, rows), expected[..., rows], rtol=1e-5, atol=SUM_ORDER_ATOL
        )
        # bfloat16 activations: what a model dequantized at load into bfloat16 computes.
        half = layer(x.bfloat16())
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half, F.linear(x.bfloat16(), weight.bfloat16(), layer.bias.bfloat16()))
    no_bias = _layer(qtype, bias=False)
    with torch.no_grad():
        assert torch.equal(no_bias(x), F.linear(x, no_bias.dequantized_weight()))


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
def test_layer_holds_the_blocks_bytes(qtype) -> None:
    layer = _layer(qtype, out_features=64, in_features=1024, bias=False)
    block, block_bytes = GGUF_BLOCKS[qtype]
    nbytes = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    assert nbytes == 64 * 1024 // block * block_bytes
    print(f"{qtype}: {nbytes / (64 * 1024 * 4):.1%} of float32")
    assert nbytes / (64 * 1024 * 4) == pytest.approx(block_bytes / (4 * block))
    assert layer.to(torch.bfloat16).weight.dtype == torch.uint8  # the blocks are not cast
    assert quantized_layer_kinds(torch.nn.Sequential(layer, torch.nn.Linear(2, 2))) == {f"GGUF {qtype}": 1}


def test_malformed_blocks_are_refused() -> None:
    blocks = torch.zeros(4, 34 * 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="runs Q8_0, Q4_K blocks, not Q5_K"):
        GGUFLinear(blocks, "Q5_K", 128)
    with pytest.raises(ValueError, match="128 Q8_0 weights a row take 136 bytes, the blocks have 100"):
        GGUFLinear(blocks[:, :100], "Q8_0", 128)
    with pytest.raises(ValueError, match="multiple of 32 weights"):
        GGUFLinear(blocks, "Q8_0", 100)
    with pytest.raises(ValueError, match="bias must have shape"):
        GGUFLinear(blocks, "Q8_0", 128, torch.zeros(5))
