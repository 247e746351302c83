"""Multi-axis rotary position embedding (RoPE) as used by FLUX.

Each token has one position per axis (FLUX: text/reference index, row, column). The head dimension is
split into one slice per axis (`axes_dims`, summing to head_dim); within an axis slice, channel pair
`(2i, 2i+1)` is rotated by the angle `pos_axis * theta ** (-2i / axis_dim)`. The channel pairs are
*interleaved* (FLUX/Diffusers `use_real_unbind_dim=-1` convention), not split into halves as in
GPT-NeoX style RoPE.

Tables are kept at half width: `cos`/`sin` are (seq, head_dim // 2), one entry per channel pair.
Diffusers stores each value twice (`repeat_interleave(2)`); the halves hold the same numbers and the
rotation below gives bit-identical results with half the table memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffserve.layers.custom_op import CustomOp

#: Half-width `(cos, sin)` rotation tables, float32, one row per position (see `RotaryEmbedding`).
RopeTables = tuple[torch.Tensor, torch.Tensor]

#: Device types without float64 support; their angles are computed in float32 (as Diffusers does).
_NO_FP64_DEVICE_TYPES = frozenset({"mps", "npu", "neuron"})


def rope_freqs_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it: angles reach ~1e3 rad for large grids and fp32 loses digits."""
    return torch.float32 if device.type in _NO_FP64_DEVICE_TYPES else torch.float64


def multi_axis_rope_tables(ids: torch.Tensor, axes_dims: Sequence[int], theta: float = 10000.0) -> RopeTables:
    """Half-width `(cos, sin)` tables, each (seq, sum(axes_dims) // 2) float32, for position `ids` (seq, n_axes).

    Mirrors Diffusers' `FluxPosEmbed` + `get_1d_rotary_pos_embed(repeat_interleave_real=True)`: ids are
    first cast to float32 (as Diffusers does), then the angles are formed and their cos/sin taken in
    float64 (float32 on devices without it) and rounded to float32 at the end.
    """
    if ids.ndim != 2 or ids.shape[1] != len(axes_dims):
        raise ValueError(f"position ids must be (seq, {len(axes_dims)}), got {tuple(ids.shape)}")
    if any(d % 2 for d in axes_dims):
        raise ValueError(f"every rotary axis dimension must be even, got {tuple(axes_dims)}")
    dtype = rope_freqs_dtype(ids.device)
    pos = ids.float().to(dtype)
    angles = []
    for axis, dim in enumerate(axes_dims):  # a handful of axes, once per table build
        inv_freq = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=dtype, device=ids.device) / dim))
        angles.append(torch.outer(pos[:, axis], inv_freq))
    angle = torch.cat(angles, dim=1)
    return angle.cos().float(), angle.sin().float()


class RotaryEmbedding(CustomOp):
    """Rotates q and k, laid out (batch, seq, heads, head_dim), by half-width `(cos, sin)` tables (seq, head_dim // 2).

    The rotation runs in float32 and the result is cast back to the input dtype, as in Diffusers'
    `apply_rotary_emb(..., use_real=True, use_real_unbind_dim=-1)`.

    `q` may hold fewer positions than `k`: its rows are then the *last* `q.shape[1]` positions of the
    tables. A DiT's final block needs outputs for the image tokens only, which follow the text tokens,
    so it can project and rotate queries for those rows alone while keys cover the whole sequence.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            # Inductor cannot generate code for complex ops: under `--compile` the complex rotation
            # would stay an eager kernel between compiled ones, while the real form fuses into the
            # QK-norm's kernel (one pass over q/k instead of three). Same products and sums, so the
            # same values (measured bit-identical on the 36M FLUX checkpoint).
            return self.forward_native(q, k, cos, sin)
        return self._forward_impl(q, k, cos, sin)

    def forward_native(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Portable real arithmetic: out = (x_r*cos - x_i*sin, x_i*cos + x_r*sin) per channel pair.
        cos = cos[None, :, None, :]
        sin = sin[None, :, None, :]
        rows = _query_rows(q, k)
        return _rotate_real(q, cos[:, rows], sin[:, rows]), _rotate_real(k, cos, sin)

    def _forward_complex(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One complex multiply per element: the same products and sums as the real form (so the same
        # rounding) but about 3x faster on CPU, as it reads x once and writes once.
        cis = torch.complex(cos, sin)[None, :, None, :]
        return _rotate_complex(q, cis[:, _query_rows(q, k)]), _rotate_complex(k, cis)

    def forward_cpu(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self._forward_complex(q, k, cos, sin)

    def forward_cuda(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self._forward_complex(q, k, cos, sin)


def _query_rows(q: torch.Tensor, k: torch.Tensor) -> slice:
    """The table positions of q's rows: the last `q.shape[1]` of k's (all of them when q covers k)."""
    return slice(k.shape[1] - q.shape[1], None)


def _rotate_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x_real, x_imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x_real * cos - x_imag * sin, x_imag * cos + x_real * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def _rotate_complex(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    # view_as_complex needs unit stride on the pair axis; `.contiguous()` is free for projection outputs.
    x_c = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(x_c * cis).flatten(-2).to(x.dtype)
