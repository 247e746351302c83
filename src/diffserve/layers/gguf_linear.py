"""`GGUFLinear`: a Linear whose weight stays in a GGUF file's quantized blocks, dequantized per layer as
it runs (`--transformer-weights model-Q8_0.gguf`, docs/memory.md), as ComfyUI-GGUF and Diffusers'
`GGUFQuantizationConfig` run city96's FLUX / Wan GGUFs: the DiT holds the file's bytes, not a
full-precision copy (Q8_0: 34 bytes per 32 weights, 27% of float32; Q4_K: 144 bytes per 256, 14%).

The blocks (`weight`, a uint8 buffer of shape (out, in / block * block bytes): a GGUF tensor's rows, as
stored) are dequantized in torch, vectorized over every block of a chunk of rows, into the
activations' dtype, and multiplied; on the CPU a chunk is cache-sized (`CPU_CHUNK_ELEMENTS`), elsewhere a
whole ordinary layer (`DEVICE_CHUNK_ELEMENTS`), so no full-precision copy of a large layer ever exists.
The arithmetic is gguf-py's reference dequantizers' (float32, same operations in the same order), so a
layer computes with exactly the weights a dequantize-at-load of the same file gives.

Block layouts (ggml, little-endian; gguf-py `quants.py`):

- Q8_0, 32 weights in 34 bytes: `d` (fp16), 32 int8 `q`; w = d * q.
- Q4_K, 256 weights in 144 bytes: `d`, `dmin` (fp16), 12 bytes of 6-bit scales and mins for 8
  sub-blocks of 32, 128 bytes of 4-bit `q` (bytes 32j..32j+31: sub-block 2j in the low nibbles, 2j+1 in
  the high ones); w = d * scale_s * q - dmin * min_s.

Other GGUF types are dequantized at load by the loader (`loader/single_file_readers/gguf_file.py`).
The layer is not an `nn.Linear`: LoRA adapters and tensor parallelism refuse it by name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.custom_op import CustomOp
from diffserve.layers.quantized_linear import CPU_CHUNK_ELEMENTS, DEVICE_CHUNK_ELEMENTS, QuantizedLinear

#: Weights dequantized at a time when a CPU layer's whole weight is built before its matmul (bf16, fp16).
CPU_DEQUANTIZE_ELEMENTS = 1 << 18
#: GGUF type -> (weights per block, bytes per block).
GGUF_BLOCKS: dict[str, tuple[int, int]] = {"Q8_0": (32, 34), "Q4_K": (256, 144)}


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block (blocks: (..., block bytes) uint8), as float32 (..., 1)."""
    return blocks[..., start : start + 2].view(torch.float16).float()


def _blocks_and_result(
    packed: torch.Tensor, block_bytes: int, block_values: int, dtype: torch.dtype, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized rows (rows, blocks * block_bytes) uint8 viewed as (rows, blocks, block_bytes), and
    the (rows, blocks * block_values) `dtype` tensor they dequantize into: `out` (checked) or a new one.
    Every GGUF block format dequantizes through these two."""
    rows = packed.shape[0]
    blocks = packed.view(rows, -1, block_bytes)
    width = blocks.shape[1] * block_values
    if out is None:
        return blocks, torch.empty(rows, width, dtype=dtype, device=packed.device)
    if out.shape != (rows, width) or out.dtype != dtype:
        raise ValueError(
            f"out must be {dtype} of shape ({rows}, {width}), got {out.dtype} {tuple(out.shape)}"
        )
    return blocks, out


def dequantize_q8_0(
    packed: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Q8_0 rows (rows, blocks * 34) uint8 -> (rows, blocks * 32) in `dtype`, computed in float32 and
    written into `out` when given."""
    rows = packed.shape[0]
    blocks, result = _blocks_and_result(packed, 34, 32, dtype, out)
    weights = blocks[..., 2:].view(torch.int8).to(torch.float32)
    torch.mul(weights, _fp16(blocks, 0), out=result.view(rows, -1, 32))  # cast to `dtype` as written
    return result


def dequantize_q4_k(
    packed: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Q4_K rows (rows, blocks * 144) uint8 -> (rows, blocks * 256) in `dtype`, computed in float32 and
    written into `out` when given."""
    rows = packed.shape[0]
    blocks, result = _blocks_and_result(packed, 144, 256, dtype, out)
    n = blocks.shape[1]
    low, high, mixed = blocks[..., 4:16].reshape(rows, n, 3, 4).unbind(2)  # scale bytes 0-3, 4-7, 8-11
    scales = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    step = _fp16(blocks, 0) * scales.float()  # (rows, n, 8): d * scale, per sub-block
    offset = _fp16(blocks, 2) * mins.float()  # dmin * min
    nibbles = blocks[..., 16:].reshape(rows, n, 4, 1, 32)
    # Converted into a float32 buffer, then scaled in place: every op on one dtype (mixed-dtype ops, a
    # uint8 times a float32 tensor, measured several times slower on the CPU).
    weights = torch.empty(rows, n, 4, 2, 32, dtype=torch.float32, device=packed.device)
    weights[..., :1, :] = nibbles & 0x0F
    weights[..., 1:, :] = nibbles >> 4
    weights = weights.view(rows, n, 8, 32).mul_(step[..., None])
    torch.sub(weights, offset[..., None], out=result.view(rows, n, 8, 32))  # cast to `dtype` as written
    return result


#: GGUF type -> its dequantizer: (blocks, dtype, out=None) -> weights.
DEQUANTIZERS: dict[str, Callable[..., torch.Tensor]] = {
    "Q8_0": dequantize_q8_0,
    "Q4_K": dequantize_q4_k,
}


def blockwise_linear(
    x: torch.Tensor,
    out_features: int,
    weight_rows: Callable[[int, int], torch.Tensor],
    bias: torch.Tensor | None,
    chunk_elements: int,
) -> torch.Tensor:
    """x @ W.T + bias where `weight_rows(start, stop)` gives rows [start, stop) of W in x's dtype, made
    `chunk_elements` weights at a time: one `F.linear` when the layer fits a chunk, else each block of
    rows multiplied into its rows of the (transposed) output."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features)
    rows = max(1, chunk_elements // max(in_features, 1))
    if rows >= out_features:
        out = F.linear(flat, weight_rows(0, out_features), bias)
    else:
        y_t = flat.new_empty(out_features, flat.shape[0])
        for start in range(0, out_features, rows):
            stop = min(start + rows, out_features)
            torch.mm(weight_rows(start, stop), flat.T, out=y_t[start:stop])
        out = y_t.T.contiguous() if bias is None else torch.add(y_t.T, bias)
    return out.reshape(*x.shape[:-1], out_features)


class GGUFLinear(CustomOp):
    """A Linear computing with GGUF-quantized weights: `weight` the blocks (out, bytes per row) uint8,
    `qtype` their type (`GGUF_BLOCKS`), `bias` (out,) in the compute dtype or None."""

    def __init__(
        self,
        weight: torch.Tensor,
        qtype: str,
        in_features: int,
        bias: torch.Tensor | None = None,
        part_names: tuple[str, ...] = (),
        part_sizes: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        if qtype not in GGUF_BLOCKS:
            raise ValueError(f"GGUFLinear runs {', '.join(GGUF_BLOCKS)} blocks, not {qtype}")
        block, block_bytes = GGUF_BLOCKS[qtype]
        if weight.dtype != torch.uint8 or weight.ndim != 2 or in_features % block:
            raise ValueError(
                f"{qtype} blocks are a 2-D uint8 tensor over rows of a multiple of {block} weights, got "
                f"{weight.dtype} {tuple(weight.shape)} for {in_features} weights a row"
            )
        if weight.shape[1] != in_features // block * block_bytes:
            raise ValueError(
                f"{in_features} {qtype} weights a row take {in_features // block * block_bytes} bytes, "
                f"the blocks have {weight.shape[1]}"
            )
        out_features = weight.shape[0]
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("weight", weight.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.part_names, self.part_sizes = part_names, part_sizes
        self._dequantize = DEQUANTIZERS[qtype]

    def dequantized_weight(
        self, dtype: torch.dtype = torch.float32, rows: slice | None = None
    ) -> torch.Tensor:
        """The (out, in) weight this layer computes with (rows `rows` of it), in `dtype` (a new tensor)."""
        packed = self.weight if rows is None else self.weight[rows]
        return self._dequantize(packed, dtype)

    def _weight(self, packed: torch.Tensor, dtype: torch.dtype, chunk_elements: int) -> torch.Tensor:
        """The blocks `packed` dequantized into one weight in `dtype`, `chunk_elements` at a time (so
        that the float32 intermediate of each chunk stays in the cache)."""
        rows = max(1, chunk_elements // self.in_features)
        if rows >= packed.shape[0]:
            return self._dequantize(packed, dtype)
        weight = torch.empty(packed.shape[0], self.in_features, dtype=dtype, device=packed.device)
        for start in range(0, packed.shape[0], rows):
            self._dequantize(packed[start : start + rows], dtype, out=weight[start : start + rows])
        return weight

    def _parts(self, x: torch.Tensor, rows: slice | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        packed = self.weight if rows is None else self.weight[rows]
        bias = self.bias if rows is None or self.bias is None else self.bias[rows]
        return packed, None if bias is None else bias.to(x.dtype)

    def forward_native(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """The layer's weight dequantized whole, one matmul (held for this layer's call only)."""
        packed, bias = self._parts(x, rows)
        return F.linear(x, self._weight(packed, x.dtype, DEVICE_CHUNK_ELEMENTS), bias)

    def forward_cpu(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """float32: each cache-sized block of rows dequantized and multiplied into its rows of the output
        (`blockwise_linear`); bfloat16 / float16, whose matmuls are faster: the weight dequantized block by
        block into one buffer, then one matmul (the faster of the two there; benchmarks/README.md)."""
        packed, bias = self._parts(x, rows)
        if x.dtype != torch.float32:
            return F.linear(x, self._weight(packed, x.dtype, CPU_DEQUANTIZE_ELEMENTS), bias)
        return blockwise_linear(
            x,
            packed.shape[0],
            lambda start, stop: self._dequantize(packed[start:stop], x.dtype),
            bias,
            CPU_CHUNK_ELEMENTS,
        )

    def forward_rows(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """Output rows `rows` only: `forward(x)[..., rows]` without the rest."""
        return self._forward_impl(x, rows)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight=GGUF {self.qtype} blocks"
        )


def quantized_layer_kinds(module: nn.Module) -> Counter[str]:
    """How many of `module`'s layers compute with quantized weights, by kind: "int8" / "fp8" (a
    `QuantizedLinear`: `--quantization`, or an FP8 checkpoint kept in FP8), "GGUF Q8_0" / "GGUF Q4_K"."""
    kinds: Counter[str] = Counter()
    for layer in module.modules():
        if isinstance(layer, QuantizedLinear):
            kinds[layer.mode] += 1
        elif isinstance(layer, GGUFLinear):
            kinds[f"GGUF {layer.qtype}"] += 1
    return kinds
