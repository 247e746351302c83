"""`Fp8DynamicLinear`: a Linear that computes in FP8 (`--quantization fp8-dynamic`, `loader/quantize.py`).

    weight:      Q_w = fp8_e4m3(W / s_w),  s_w = max|W[o, :]| / 448     one scale per output channel, at load
    activations: Q_x = fp8_e4m3(x / s_x),  s_x = max|x[t, :]| / 448     one scale per token, every call
    y = (Q_x @ Q_w.T) * s_x * s_w + b                                    torch._scaled_mm, bf16 out

Unlike the weight-only modes (`QuantizedLinear`, `--quantization int8|fp8`), whose matmul runs in the
compute dtype after converting the weight, the product itself runs on the FP8 tensor cores (W8A8 with
dynamic per-token scales, as SGLang and vLLM run FP8 checkpoints): about twice the bf16 matmul rate on
Hopper, with the error of rounding both operands to e4m3 (3 mantissa bits).

It runs only where `torch._scaled_mm` takes FP8 operands with per-row and per-column scales: NVIDIA GPUs
of compute capability 8.9 (Ada) and newer. Binding it to any other device (`bind_platform`, which the
loader does for every model) raises `Fp8ComputeUnavailableError` naming the device: there is no slow
substitute, since a user who asked for FP8 compute would otherwise get something else silently. The
arithmetic is still testable without such a GPU: `use_matmul` swaps in another implementation of
`_scaled_mm`'s contract (the tests use `diffserve.testing.fp8_emulation.emulated_scaled_mm`, a
dequantize-then-matmul reference, and the CPU build of `torch._scaled_mm`, which computes the same).

The layer is a `QuantizedLinear` (its storage, `from_quantized`, `forward_rows` for fused parts, the
refusal of dtype casts), so everything that recognises quantized layers (LoRA refusal, memory sizes,
logs) treats it as one; its `mode` is "fp8-dynamic".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from diffserve.layers.quantized_linear import QuantizedLinear, quantize_weight
from diffserve.platforms.base import Platform

#: The mode name of `--quantization`.
MODE = "fp8-dynamic"
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
#: `_scaled_mm` takes FP8 operands whose inner and outer dims are multiples of this.
DIM_MULTIPLE = 16
#: The oldest NVIDIA compute capability with FP8 tensor cores (Ada, sm89).
MIN_CAPABILITY = (8, 9)

#: `torch._scaled_mm`'s signature, as this layer calls it.
ScaledMatmul = Callable[..., torch.Tensor]


class Fp8ComputeUnavailableError(RuntimeError):
    """FP8 compute was asked for on a device that cannot run it; the message names the device."""


def fp8_compute_unavailable_reason(platform: Platform) -> str | None:
    """Why `platform`'s device cannot run FP8 matmuls with per-token scales, or None when it can.

    It needs an NVIDIA GPU of compute capability >= 8.9 and a torch whose `_scaled_mm` takes row-wise
    scales there: checked with one 16x16 product on the device (once per call of this function)."""
    device = platform.device()
    if platform.dispatch_key != "cuda":
        return (
            f"FP8 compute (--quantization {MODE}) needs an NVIDIA GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell); this engine runs on "
            f"{platform.device_name()} ({platform.name}, {device}), which has no FP8 matmul. Use "
            "--quantization int8 or fp8 (weight-only) there"
        )
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < MIN_CAPABILITY:
        return (
            f"FP8 compute (--quantization {MODE}) needs compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; {platform.device_name()} ({device}) has "
            f"{capability[0]}.{capability[1]}. Use --quantization fp8 (weight-only) there"
        )
    try:
        probe = torch.ones(DIM_MULTIPLE, DIM_MULTIPLE, device=device).to(FP8)
        scale_a = torch.ones(DIM_MULTIPLE, 1, device=device)
        scale_b = torch.ones(1, DIM_MULTIPLE, device=device)
        torch._scaled_mm(probe, probe.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            f"FP8 compute (--quantization {MODE}): this torch ({torch.__version__}) cannot run FP8 matmuls with "
            f"per-token scales on {platform.device_name()} ({device}): {first_line}"
        )
    return None


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q_x, s_x) of a (rows, in) activation: e4m3 values and one float32 scale per row (all-zero rows:
    scale 1, so the product stays exactly zero)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).to(FP8), scale


def fp8_dynamic_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    scaled_mm: ScaledMatmul,
) -> torch.Tensor:
    """x @ (diag(weight_scale) Q_w).T + bias with x quantized per token on the fly, through `scaled_mm`
    (`torch._scaled_mm` or a stand-in of the same contract): x bf16 (..., in), weight e4m3 (out, in)."""
    flat = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = quantize_activations(flat)
    y = scaled_mm(
        x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :], bias=bias, out_dtype=x.dtype
    )
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_dynamic_supported_shape(linear: nn.Module) -> bool:
    """Whether `_scaled_mm` can take this Linear's weight: both dims multiples of `DIM_MULTIPLE`."""
    out_features, in_features = linear.weight.shape
    return out_features % DIM_MULTIPLE == 0 and in_features % DIM_MULTIPLE == 0


class Fp8DynamicLinear(QuantizedLinear):
    """A Linear computing in FP8 (see the module docstring): `weight` (out, in) float8_e4m3fn,
    `weight_scale` (out,) float32, `bias` (out,) bf16 or None. Build it with `from_linear`; it computes
    only once bound to a platform with FP8 compute (or given a stand-in matmul with `use_matmul`)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.weight.dtype != FP8:
            raise TypeError(f"an {type(self).__name__} holds a {FP8} weight, got {self.weight.dtype}")
        if self.in_features % DIM_MULTIPLE or self.out_features % DIM_MULTIPLE:
            raise ValueError(
                f"FP8 matmuls need both weight dims to be multiples of {DIM_MULTIPLE}, got "
                f"({self.out_features}, {self.in_features})"
            )
        self._scaled_mm: ScaledMatmul | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str = MODE) -> Fp8DynamicLinear:  # type: ignore[override]
        """`linear` with its weight quantized to e4m3 per output channel (the bias kept as it is)."""
        if mode != MODE:
            raise ValueError(f"{cls.__name__} is the {MODE!r} mode, not {mode!r}")
        weight, scale = quantize_weight(linear.weight.detach(), "fp8")
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias, getattr(linear, "part_names", ()), getattr(linear, "part_sizes", ()))

    @property
    def mode(self) -> str:
        return MODE

    def bind_platform(self, platform: Platform) -> None:
        """Compute with `torch._scaled_mm` on `platform`'s device; `Fp8ComputeUnavailableError` (naming the
        device) where that device has no FP8 matmul."""
        reason = fp8_compute_unavailable_reason(platform)
        if reason is not None:
            raise Fp8ComputeUnavailableError(reason)
        super().bind_platform(platform)
        self._scaled_mm = torch._scaled_mm

    def use_matmul(self, scaled_mm: ScaledMatmul) -> None:
        """Compute with `scaled_mm` instead of the device's `torch._scaled_mm`: for tests, which check the
        layer's arithmetic on a machine without FP8 compute (never called by the engine)."""
        self._scaled_mm = scaled_mm
        self._forward_impl = self.forward_native

    def forward_native(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        if self._scaled_mm is None:
            raise Fp8ComputeUnavailableError(
                f"an {type(self).__name__} computes only once bound to a platform with FP8 compute "
                "(the loader binds every model it loads)"
            )
        if x.dtype != torch.bfloat16:
            raise TypeError(f"FP8 compute (--quantization {MODE}) takes bf16 activations, got {x.dtype}")
        return fp8_dynamic_matmul(x, *self._tensors(rows), self._scaled_mm)

    def forward_cuda(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        return self.forward_native(x, rows)

    def extra_repr(self) -> str:
        return (
            super().extra_repr().replace(f"weight={self.mode} per-channel", f"weight=fp8 per-channel, {MODE}")
        )
