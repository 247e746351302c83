"""Multi-axis rotary position embedding (RoPE) as used by FLUX: one position per token and axis, one
head-dim slice per axis (`axes_dims`), the *interleaved* channel pair `(2i, 2i+1)` of a slice rotated by
`pos_axis * theta ** (-2i / axis_dim)`. Tables are half width, one entry per pair (Diffusers stores each
value twice; same results, half the memory)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffserve.layers.custom_op import CustomOp

RopeTables = tuple[torch.Tensor, torch.Tensor]

# Without float64: angles in float32 (as Diffusers does).
_NO_FP64_DEVICE_TYPES = frozenset({"mps", "npu", "neuron"})


def checked_rope_axes(
    name: str, axes_dims: Sequence[int], head_dim: int, count: int | None = None
) -> tuple[int, ...]:
    """`axes_dims` (a config field called `name`) as a tuple of ints, checked for what multi-axis RoPE
    needs: `count` entries (when given), each even (a slice rotates channel pairs), summing to the
    attention head width (the slices tile the head). Configs call it from `__post_init__`, so a bad
    checkpoint config fails at load, not at the first forward."""
    axes = tuple(int(d) for d in axes_dims)
    if count is not None and len(axes) != count:
        raise ValueError(f"{name} must have {count} entries, got {axes}")
    if any(d % 2 for d in axes):
        raise ValueError(f"every entry of {name} must be even, got {axes}")
    if sum(axes) != head_dim:
        raise ValueError(f"{name} {axes} must sum to attention_head_dim ({head_dim})")
    return axes


def multi_axis_rope_tables(ids: torch.Tensor, axes_dims: Sequence[int], theta: float = 10000.0) -> RopeTables:
    """Half-width float32 `(cos, sin)` tables for position `ids` (seq, n_axes), as Diffusers' `FluxPosEmbed`:
    angles in float64 (they reach ~1e3 rad on large grids) where the device has it."""
    if ids.ndim != 2 or ids.shape[1] != len(axes_dims):
        raise ValueError(f"position ids must be (seq, {len(axes_dims)}), got {tuple(ids.shape)}")
    if any(d % 2 for d in axes_dims):
        raise ValueError(f"every rotary axis dimension must be even, got {tuple(axes_dims)}")
    dtype = torch.float32 if ids.device.type in _NO_FP64_DEVICE_TYPES else torch.float64
    pos = ids.float().to(dtype)
    angles = []
    for axis, dim in enumerate(axes_dims):  # a handful of axes, once per table build
        inv_freq = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=dtype, device=ids.device) / dim))
        angles.append(torch.outer(pos[:, axis], inv_freq))
    angle = torch.cat(angles, dim=1)
    return angle.cos().float(), angle.sin().float()


def grid_rope_tables(
    sizes: Sequence[int], axes_dims: Sequence[int], theta: float, device: torch.device
) -> RopeTables:
    """Half-width float32 (cos, sin) tables (prod(sizes), head_dim // 2) for a post-patch grid of `sizes`
    (one position per axis: frame, row, column, ...), in the flattened patch order (first axis slowest);
    angles in float32, as Diffusers' HunyuanVideo-style position embeddings compute them."""
    axes = [torch.arange(n, device=device, dtype=torch.float32) for n in sizes]
    grid = torch.meshgrid(*axes, indexing="ij")
    angles = []
    for pos, dim in zip(grid, axes_dims, strict=True):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        angles.append(torch.outer(pos.reshape(-1), inv_freq))
    angle = torch.cat(angles, dim=1)
    return angle.cos(), angle.sin()


class RotaryEmbedding(CustomOp):
    """Rotates q and k (batch, seq, heads, head_dim) by the tables in float32, as Diffusers'
    `apply_rotary_emb(..., use_real=True)`. `q` may hold only the *last* `q.shape[1]` positions (a DiT's
    final block queries the image tokens, after the text, only)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            # Inductor cannot generate complex ops; the real form (same values) fuses into the QK-norm.
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
        # The real form's products and sums (same rounding), reading and writing x once.
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
