"""The gated residual add of adaLN-Zero blocks (alone, and as a double-stream block's attention-then-MLP
update of one stream), and the fp16 clamp of the residual stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from diffserve.layers.modulation import Modulate

FP16_MAX = 65504


def gated_residual(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`residual + gate * x`, added in place into the fresh product (same rounding, one buffer less)."""
    return (gate * x).add_(residual)


def fp16_clip(x: torch.Tensor) -> torch.Tensor:
    """Diffusers clamps the residual stream in fp16 so that activation outliers do not become inf."""
    return x.clip(-FP16_MAX, FP16_MAX) if x.dtype == torch.float16 else x


def attention_mlp_residuals(
    x: torch.Tensor,
    attn_out: torch.Tensor,
    mods: Sequence[torch.Tensor],
    norm: Callable[[torch.Tensor], torch.Tensor],
    mlp: Callable[[torch.Tensor], torch.Tensor],
    modulate: Modulate,
) -> torch.Tensor:
    """One stream of an adaLN-Zero double-stream block after its attention (FLUX.1, FLUX.2 and
    HunyuanVideo 1.5 share it): `x + gate_attn * attn_out`, then `+ gate_mlp * mlp(modulated norm(x))`.

    `mods` is (gate_attn, shift_mlp, scale_mlp, gate_mlp), each (batch, dim), broadcast over the
    sequence; the operations and their order are Diffusers', so each model's outputs stay bit-identical.
    """
    gate_attn, shift_mlp, scale_mlp, gate_mlp = mods
    x = gated_residual(x, gate_attn.unsqueeze(1), attn_out)
    ff_in = modulate(norm(x), scale=scale_mlp, shift=shift_mlp)
    return gated_residual(x, gate_mlp.unsqueeze(1), mlp(ff_in))
