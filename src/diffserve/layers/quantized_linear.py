"""`QuantizedLinear`: a Linear whose weight is stored in 8 bits, int8 or FP8 (e4m3), with one scale per
output channel: weight-only quantization of a DiT (`--quantization`, `loader/quantize.py`).

    W ~= diag(scale) @ Q      int8: Q = round(W / scale) in [-127, 127], scale = max|row| / 127
                              fp8:  Q = fp8(W / scale) in [-448, 448],    scale = max|row| / 448
    y = x @ W.T + b = (x @ Q.T) * scale + b

The weight (`weight`, int8 or float8_e4m3fn) and its scales (`weight_scale`, float32) are buffers, the
bias stays a parameter in the compute dtype: the layer's bytes are what it holds (about a quarter of a
float32 Linear's, half of a bf16 one's). Activations stay in the compute dtype. The matmul, chosen per
platform (`CustomOp`):

- Everywhere (`dequantized_matmul`): the 8-bit weight is converted to the compute dtype (exactly: int8
  and e4m3 values are representable in bf16, fp16 and fp32) a block of rows at a time, multiplied, and
  the product scaled per output channel (in fp16 the weight is scaled first, since products of unscaled
  int8 values may overflow). On the CPU the blocks are cache-sized, so that the conversion costs little
  next to the product; elsewhere a block is a whole ordinary layer, and only giant ones are split.
- CPU, int8, bf16 activations of at most `INT8_KERNEL_MAX_ROWS` rows (FLUX's adaLN projection, which
  reads one row per sample): torch's int8 weight-only kernel `aten._weight_int8pack_mm`, faster there
  and slower for more rows. It needs in_features % 16 == 0 (other widths crash it in torch 2.13), and
  is left out of `torch.compile`d graphs (inductor 2.13 fails to lower it on inputs computed in-graph).
- CUDA with compute capability >= 9.0, fp8, bf16 activations, both dims % 16 == 0: `torch._scaled_mm`
  on activations quantized to FP8 per row on the fly (W8A8 with dynamic scales, as SGLang and vLLM run
  FP8), per-row activation scales times per-channel weight scales. Not run by the tests, which have no
  such GPU; its arithmetic is tested on the CPU, whose `_scaled_mm` takes the same arguments.

`from_linear` quantizes a full-precision Linear; `from_quantized` wraps weights that are already
quantized (a pre-quantized FP8 checkpoint: per-channel or per-tensor scales). A fused layer keeps its
`part_names`/`part_sizes`. It is not an `nn.Linear`, so no code takes it for a full-precision one (LoRA
wrapping, `.weight` matmuls); `forward_rows` computes a slice of the output rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.custom_op import CustomOp
from diffserve.platforms.base import Platform

#: Quantization mode -> (storage dtype, largest magnitude a weight is scaled to).
QUANTIZED_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),
}
_MODE_OF_DTYPE = {dtype: mode for mode, (dtype, _) in QUANTIZED_FORMATS.items()}

#: The CPU int8 kernel runs for bf16 inputs of at most this many rows (batch x tokens): its time grows
#: with the rows like a matrix-vector product's, and past 8 rows chunked dequantization is faster
#: (measured one thread, FLUX.1 layer shapes; docs/memory.md).
INT8_KERNEL_MAX_ROWS = 8
#: Weights converted per chunk by the dequantizing matmul on the CPU: a block that stays in the cache
#: between its conversion and its product. Measured on one thread at FLUX.1's layer shapes (256-320
#: tokens): 1.0-1.1x the full-precision matmul's time in fp32, 1.15-1.2x in bf16, against 1.3-1.9x when
#: the whole weight is converted first (blocks of 2^20 to 2^23 weights are all within a few percent).
CPU_CHUNK_ELEMENTS = 1 << 21
#: ... and on other devices: whole layers of FLUX.1's size in one matmul, while a giant one (FLUX's fused
#: adaLN projection, 3.2B weights) never has a full-precision copy of itself.
DEVICE_CHUNK_ELEMENTS = 1 << 26
#: Quantizing converts the weight to float32 this many elements at a time (bounds the transient memory).
_QUANTIZE_CHUNK_ELEMENTS = 1 << 24


def quantize_weight(weight: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, scale) of a full-precision (out, in) weight: symmetric, one float32 scale per output row.

    Rows are converted to float32 a chunk at a time, so quantizing a large layer takes little more
    memory than its quantized copy. An all-zero row gets scale 1 (its Q is zero)."""
    if mode not in QUANTIZED_FORMATS:
        raise ValueError(
            f"unknown quantization mode {mode!r}; expected one of {', '.join(QUANTIZED_FORMATS)}"
        )
    if weight.ndim != 2:
        raise ValueError(f"a Linear weight is 2-D, got shape {tuple(weight.shape)}")
    dtype, qmax = QUANTIZED_FORMATS[mode]
    out_features, in_features = weight.shape
    quantized = torch.empty(out_features, in_features, dtype=dtype, device=weight.device)
    scale = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    if weight.is_meta:  # no values: the quantized layout alone (sizing a model without allocating it)
        return quantized, scale
    rows = max(1, _QUANTIZE_CHUNK_ELEMENTS // max(in_features, 1))
    with torch.no_grad():
        for start in range(0, out_features, rows):
            chunk = weight[start : start + rows].float()
            amax = chunk.abs().amax(dim=1)
            chunk_scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
            scaled = chunk / chunk_scale[:, None]
            if dtype == torch.int8:
                scaled = scaled.round_().clamp_(-qmax, qmax)
            quantized[start : start + rows] = scaled.to(dtype)
            scale[start : start + rows] = chunk_scale
    return quantized, scale


def dequantized_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_elements: int = DEVICE_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """x @ (diag(scale) Q).T + bias in x's dtype, converting the 8-bit Q to x's dtype (exactly: int8 and
    e4m3 values are all representable in bf16, fp16 and fp32) `chunk_elements` weights at a time.

    A layer within one chunk is one `F.linear` by the converted weight, whose product is then scaled per
    output channel. A larger one is converted a block of rows at a time, each block's product written
    into its rows of the (transposed) output, so no full-precision copy of the whole weight ever exists.
    In fp16 the scale is applied to the weight before the product instead (products of unscaled int8
    values could exceed fp16's range)."""
    dtype, (out_features, in_features) = x.dtype, weight.shape
    flat = x.reshape(-1, in_features)
    rows = max(1, chunk_elements // in_features)
    half = dtype == torch.float16

    def converted(start: int, stop: int) -> torch.Tensor:
        block = weight[start:stop]
        return (block.float() * scale[start:stop, None]).to(dtype) if half else block.to(dtype)

    if rows >= out_features:
        y = F.linear(flat, converted(0, out_features))
    else:
        y_t = flat.new_empty(out_features, flat.shape[0])
        for start in range(0, out_features, rows):
            stop = min(start + rows, out_features)
            torch.mm(converted(start, stop), flat.T, out=y_t[start:stop])
        y = y_t.T
    out = flat.new_empty(flat.shape[0], out_features)
    if half and bias is None:
        out.copy_(y)
    elif half:
        torch.add(y, bias, out=out)
    elif bias is None:
        torch.mul(y, scale.to(dtype), out=out)
    else:
        torch.addcmul(bias, y, scale.to(dtype), out=out)
    return out.reshape(*x.shape[:-1], out_features)


def int8_kernel_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The same product through `aten._weight_int8pack_mm` (CPU; x 2-D or more, in_features % 16 == 0)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(flat, weight, scale.to(x.dtype))
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y.add_(bias)


def fp8_scaled_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ (diag(scale) Q).T + bias by `torch._scaled_mm` with x quantized to FP8 per row on the fly.

    x: bf16 (..., in); weight: float8_e4m3fn (out, in); both dims multiples of 16. Each row of x gets
    the scale max|row| / 448; the product of two FP8 matrices is rescaled by (row scale x channel scale)
    in the kernel and returned in bf16."""
    fp8 = weight.dtype
    flat = x.reshape(-1, x.shape[-1])
    row_amax = flat.abs().amax(dim=1, keepdim=True).float()
    row_scale = torch.where(row_amax > 0, row_amax / torch.finfo(fp8).max, torch.ones_like(row_amax))
    x_fp8 = (flat.float() / row_scale).to(fp8)
    y = torch._scaled_mm(
        x_fp8, weight.t(), scale_a=row_scale, scale_b=scale[None, :], bias=bias, out_dtype=x.dtype
    )
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _has_fp8_row_scaled_mm(platform: Platform) -> bool:
    """Whether the platform's device runs `_scaled_mm` with per-row scales: NVIDIA compute capability
    9.0 and up (PyTorch implements row-wise FP8 scaling for sm90+)."""
    if platform.dispatch_key != "cuda":
        return False
    return torch.cuda.get_device_capability(platform.device()) >= (9, 0)


class QuantizedLinear(CustomOp):
    """A weight-only quantized Linear: `weight` (out, in) int8 or float8_e4m3fn, `weight_scale` (out,)
    float32, `bias` (out,) in the compute dtype or None. Build it with `from_linear` or `from_quantized`."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        part_names: tuple[str, ...] = (),
        part_sizes: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        if weight.dtype not in _MODE_OF_DTYPE or weight.ndim != 2:
            raise TypeError(
                f"a quantized weight is 2-D {' or '.join(map(str, _MODE_OF_DTYPE))}, got "
                f"{weight.dtype} of shape {tuple(weight.shape)}"
            )
        out_features, in_features = weight.shape
        if weight_scale.shape != (out_features,) or weight_scale.dtype != torch.float32:
            raise ValueError(
                f"weight_scale must be float32 of shape ({out_features},), got {weight_scale.dtype} "
                f"{tuple(weight_scale.shape)}"
            )
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        if len(part_names) != len(part_sizes) or (part_sizes and sum(part_sizes) != out_features):
            raise ValueError(f"parts {part_names} of sizes {part_sizes} do not make {out_features} rows")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.part_names, self.part_sizes = part_names, part_sizes
        self._fp8_scaled_mm = False  # set by `bind_platform`

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str) -> QuantizedLinear:
        """`linear` quantized (`mode` "int8" or "fp8"); a FusedLinear's parts carry over. The bias is kept
        as it is (same tensor)."""
        weight, scale = quantize_weight(linear.weight.detach(), mode)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias, getattr(linear, "part_names", ()), getattr(linear, "part_sizes", ()))

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        part_names: tuple[str, ...] = (),
        part_sizes: tuple[int, ...] = (),
    ) -> QuantizedLinear:
        """Wrap an already-quantized weight, as a pre-quantized checkpoint stores it: `weight` (out, in)
        float8_e4m3fn (or int8), `scale` its dequantization factor per output channel ((out,) or (out, 1))
        or per tensor (one element: ComfyUI's `scale_weight`), so that the full-precision weight is
        `weight * scale`. A per-tensor scale is expanded to every channel (the same products)."""
        out_features = weight.shape[0]
        scale = scale.detach().to(device=weight.device, dtype=torch.float32)
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(out_features).contiguous()
        elif scale.numel() == out_features:
            scale = scale.reshape(out_features).contiguous()
        else:
            raise ValueError(
                f"a weight scale has one element or one per output channel ({out_features}), got shape "
                f"{tuple(scale.shape)}"
            )
        return cls(weight.detach(), scale, None if bias is None else bias.detach(), part_names, part_sizes)

    @property
    def mode(self) -> str:
        """ "int8" or "fp8"."""
        return _MODE_OF_DTYPE[self.weight.dtype]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) full-precision weight this layer computes with, in `dtype` (a new tensor)."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    # -- matmul dispatch ----------------------------------------------------------------------------

    def bind_platform(self, platform: Platform) -> None:
        super().bind_platform(platform)
        self._fp8_scaled_mm = self.weight.dtype == torch.float8_e4m3fn and _has_fp8_row_scaled_mm(platform)

    def _tensors(self, rows: slice | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if rows is None:
            return self.weight, self.weight_scale, self.bias
        bias = None if self.bias is None else self.bias[rows]
        return self.weight[rows], self.weight_scale[rows], bias

    def forward_native(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        return dequantized_matmul(x, *self._tensors(rows))

    def forward_cpu(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        weight, scale, bias = self._tensors(rows)
        if (
            weight.dtype == torch.int8
            and x.dtype == torch.bfloat16
            and self.in_features % 16 == 0
            and x.numel() <= INT8_KERNEL_MAX_ROWS * self.in_features
            and not torch.compiler.is_compiling()  # inductor cannot lower it on in-graph inputs (2.13)
        ):
            return int8_kernel_matmul(x, weight, scale, bias)
        return dequantized_matmul(x, weight, scale, bias, CPU_CHUNK_ELEMENTS)

    def forward_cuda(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        weight, scale, bias = self._tensors(rows)
        if (
            self._fp8_scaled_mm
            and x.dtype == torch.bfloat16
            and self.in_features % 16 == 0
            and weight.shape[0] % 16 == 0
        ):
            return fp8_scaled_matmul(x, weight, scale, bias)
        return dequantized_matmul(x, weight, scale, bias)

    def forward_rows(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """Output rows `rows` only (a fused layer's part): `forward(x)[..., rows]` without the rest."""
        return self._forward_impl(x, rows)

    # -- module plumbing ----------------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """Moves between devices keep the 8-bit storage; a cast (`.to(dtype)`, `.half()`) would turn the
        FP8 weight and the scales into wide tensors, so it is refused before anything changes."""
        for tensor in (self.weight, self.weight_scale):
            if fn(tensor.new_empty(0)).dtype != tensor.dtype:
                raise TypeError(
                    f"a QuantizedLinear ({self.mode}) keeps its dtypes: cast the model before quantizing it"
                )
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        parts = (
            f", parts={list(zip(self.part_names, self.part_sizes, strict=True))}" if self.part_names else ""
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.mode} per-channel{parts}"
        )


def linear_rows(layer: nn.Module, x: torch.Tensor, rows: slice) -> torch.Tensor:
    """`layer(x)[..., rows]` computing only those output rows, for a full-precision or quantized Linear
    (a `QuantizedLinear`, a `layers/gguf_linear.py::GGUFLinear`: their own `forward_rows`)."""
    if not isinstance(layer, nn.Linear):
        return layer.forward_rows(x, rows)
    return F.linear(x, layer.weight[rows], None if layer.bias is None else layer.bias[rows])
