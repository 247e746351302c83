"""Rotary position embedding (RoPE) of the LTX-2 audio-video DiT and its text connectors.

LTX-2 rotates the *whole* projected query/key width (all heads at once, before the head split) by
angles built from fractional positions:

    position  = midpoint of each token's [start, end) patch bounds, divided by a per-axis maximum
                (video: seconds / `pos_embed_max_pos`, pixels / `base_height`, pixels / `base_width`;
                audio: seconds / `audio_pos_embed_max_pos`; connectors: token index / base length)
    freq_j    = theta ** (j / (F - 1)) * pi / 2, j < F = dim // (2 * n_axes)  (float64, then float32)
    angle     = (2 * position - 1) * freq_j, ordered frequency-major, axis-minor

The angle vector is left-padded with identity rotations (cos 1, sin 0) to dim // 2 entries. Two
channel layouts exist (`rope_type`):

* "interleaved": entry i rotates the channel pair (2i, 2i + 1) of the full width;
* "split": the dim // 2 entries are cut into `heads` groups of r; entry (h, i) rotates channels
  (h * 2r + i, h * 2r + r + i). `heads` is the head count the *table* was built for (Diffusers builds
  the audio/video cross-attention table with the video head count), not necessarily the attention's.

Tables are kept half width (B, N, dim // 2) in float32, one per batch row: the positions come from
the caller (`video_coords` / `audio_coords`) and may differ per row. The coordinate builders mirror
Diffusers' `prepare_video_coords` / `prepare_audio_coords`, which the LTX-2 pipelines call on
`transformer.rope` and `transformer.audio_rope`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

ROPE_TYPES = ("interleaved", "split")
MODALITIES = ("video", "audio")


@dataclass(frozen=True)
class LTX2Rope:
    """Half-width float32 (cos, sin) tables (batch, tokens, dim // 2) and how they map onto channels."""

    cos: torch.Tensor
    sin: torch.Tensor
    rope_type: str
    heads: int


def check_rope_type(rope_type: str) -> None:
    """ValueError unless `rope_type` is one Diffusers implements."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")


def ltx2_rope_tables(
    positions: torch.Tensor,
    dim: int,
    theta: float,
    double_precision: bool,
    rope_type: str,
    heads: int,
) -> LTX2Rope:
    """Tables for fractional `positions` (batch, tokens, n_axes) over a rotated width of `dim` channels."""
    check_rope_type(rope_type)
    if dim % 2:
        raise ValueError(f"the rotated width must be even, got {dim}")
    n_axes = positions.shape[-1]
    steps = dim // (2 * n_axes)
    freqs_dtype = torch.float64 if double_precision else torch.float32
    exponents = torch.linspace(0.0, 1.0, steps=steps, dtype=freqs_dtype, device=positions.device)
    freqs = (torch.pow(theta, exponents) * math.pi / 2.0).to(torch.float32)
    # (batch, tokens, axes, steps) -> frequency-major, axis-minor (batch, tokens, steps * axes)
    angles = ((positions.unsqueeze(-1) * 2 - 1) * freqs).transpose(-1, -2).flatten(2)
    cos, sin = angles.cos(), angles.sin()
    pad = dim // 2 - angles.shape[-1]
    if pad:
        cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], dim=-1)
        sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], dim=-1)
    if rope_type == "split" and (dim // 2) % heads:
        raise ValueError(f"split RoPE: dim // 2 = {dim // 2} does not divide into {heads} heads")
    return LTX2Rope(cos, sin, rope_type, heads)


def apply_ltx2_rope(x: torch.Tensor, rope: LTX2Rope) -> torch.Tensor:
    """Rotate (batch, tokens, dim) projections in float32 (Diffusers' arithmetic), result in x's dtype."""
    if rope.rope_type == "interleaved":
        x_real, x_imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = rope.cos, rope.sin
        out = torch.stack((x_real * cos - x_imag * sin, x_imag * cos + x_real * sin), dim=-1)
        return out.flatten(-2).to(x.dtype)
    # split: per table head, the first half of the group pairs with the second half.
    groups = x.float().unflatten(-1, (rope.heads, 2, -1))  # (batch, tokens, heads, 2, r)
    cos = rope.cos.unflatten(-1, (rope.heads, 1, -1))
    sin = rope.sin.unflatten(-1, (rope.heads, -1))
    out = groups * cos
    out[..., 0, :].addcmul_(-sin, groups[..., 1, :])
    out[..., 1, :].addcmul_(sin, groups[..., 0, :])
    return out.flatten(-3).to(x.dtype)


class LTX2RotaryPosEmbed(nn.Module):
    """One RoPE of the DiT (video, audio, or the temporal-only audio/video cross-attention tables).

    Holds no parameters (Diffusers' `LTX2AudioVideoRotaryPosEmbed` has none either). `forward` turns
    patch bounds (batch, axes, tokens, 2) or positions (batch, axes, tokens) into `LTX2Rope` tables.
    """

    def __init__(
        self,
        dim: int,
        patch_size: int,
        patch_size_t: int,
        base_num_frames: int,
        base_height: int,
        base_width: int,
        sampling_rate: int,
        hop_length: int,
        scale_factors: Sequence[int],
        theta: float,
        causal_offset: int,
        modality: str,
        double_precision: bool,
        rope_type: str,
        num_attention_heads: int,
    ) -> None:
        super().__init__()
        check_rope_type(rope_type)
        if modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")
        self.dim = dim
        self.patch_size = patch_size
        self.patch_size_t = patch_size_t
        self.base_num_frames = base_num_frames
        self.base_height = base_height
        self.base_width = base_width
        self.sampling_rate = sampling_rate
        self.hop_length = hop_length
        self.scale_factors = tuple(int(s) for s in scale_factors)
        self.theta = theta
        self.causal_offset = causal_offset
        self.modality = modality
        self.double_precision = double_precision
        self.rope_type = rope_type
        self.num_attention_heads = num_attention_heads

    def prepare_video_coords(
        self,
        batch_size: int,
        num_frames: int,
        height: int,
        width: int,
        device: torch.device,
        fps: float = 24.0,
    ) -> torch.Tensor:
        """Pixel-space [start, end) bounds (batch, 3, F*H*W, 2) of each latent patch, frames in seconds.

        Latent indices are scaled by the VAE factors; the first latent frame covers one pixel frame
        (causal VAE), so frame bounds are shifted by `causal_offset - temporal factor` and clamped at 0.
        Tokens are in (frame, row, column) row-major order.
        """
        axes = [
            torch.arange(0, n, step, dtype=torch.float32, device=device)
            for n, step in (
                (num_frames, self.patch_size_t),
                (height, self.patch_size),
                (width, self.patch_size),
            )
        ]
        starts = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # (3, F, H, W)
        sizes = torch.tensor(
            (self.patch_size_t, self.patch_size, self.patch_size), dtype=torch.float32, device=device
        )
        bounds = torch.stack([starts, starts + sizes.view(3, 1, 1, 1)], dim=-1).flatten(1, 3)
        bounds = bounds.unsqueeze(0).repeat(batch_size, 1, 1, 1)
        scale = torch.tensor(self.scale_factors, device=device).view(1, -1, 1, 1)
        pixels = bounds * scale
        pixels[:, 0] = (pixels[:, 0] + self.causal_offset - self.scale_factors[0]).clamp(min=0)
        pixels[:, 0] = pixels[:, 0] / fps
        return pixels

    def prepare_audio_coords(
        self, batch_size: int, num_frames: int, device: torch.device, shift: int = 0
    ) -> torch.Tensor:
        """[start, end) bounds in seconds (batch, 1, frames, 2) of each audio latent frame.

        Latent frames are scaled back to mel frames (first frame causal as for video) and converted to
        seconds by hop_length / sampling_rate; `shift` offsets the latent indices.
        """
        factor = self.scale_factors[0]
        frames = torch.arange(
            shift, num_frames + shift, self.patch_size_t, dtype=torch.float32, device=device
        )

        def seconds(mel_index: torch.Tensor) -> torch.Tensor:
            mel = (mel_index * factor + self.causal_offset - factor).clip(min=0)
            return mel * self.hop_length / self.sampling_rate

        bounds = torch.stack([seconds(frames), seconds(frames + self.patch_size_t)], dim=-1)
        return bounds.unsqueeze(0).expand(batch_size, -1, -1).unsqueeze(1)

    def forward(self, coords: torch.Tensor) -> LTX2Rope:
        """Tables for patch bounds (batch, axes, tokens, 2) (midpoints are used) or positions (batch, axes, tokens)."""
        if coords.ndim == 4:
            start, end = coords.chunk(2, dim=-1)
            coords = ((start + end) / 2.0).squeeze(-1)
        if coords.ndim != 3:
            raise ValueError(
                f"RoPE coordinates must be (batch, axes, tokens[, 2]), got {tuple(coords.shape)}"
            )
        if self.modality == "video":
            max_positions: tuple[int, ...] = (self.base_num_frames, self.base_height, self.base_width)
        else:
            max_positions = (self.base_num_frames,)
        n_axes = coords.shape[1]
        if n_axes > len(max_positions):
            raise ValueError(
                f"{self.modality} RoPE takes at most {len(max_positions)} coordinate axes, got {n_axes}"
            )
        positions = torch.stack([coords[:, i] / max_positions[i] for i in range(n_axes)], dim=-1)
        return ltx2_rope_tables(
            positions, self.dim, self.theta, self.double_precision, self.rope_type, self.num_attention_heads
        )


def connector_rope(
    batch_size: int,
    seq_len: int,
    dim: int,
    base_seq_len: int,
    theta: float,
    double_precision: bool,
    rope_type: str,
    heads: int,
    device: torch.device,
) -> LTX2Rope:
    """1-D tables of the text connectors: token i sits at i / base_seq_len."""
    positions = torch.arange(seq_len, dtype=torch.float32, device=device) / base_seq_len
    positions = positions.unsqueeze(0).repeat(batch_size, 1).unsqueeze(-1)
    return ltx2_rope_tables(positions, dim, theta, double_precision, rope_type, heads)
