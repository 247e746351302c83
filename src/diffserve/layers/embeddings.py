"""Conditioning embeddings shared by DiTs: timestep sinusoids, their MLP, and pooled-text projection.

Parameter names follow Diffusers (`linear_1`, `linear_2`, `timestep_embedder`, `guidance_embedder`,
`text_embedder`) so checkpoints load without renaming.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_sinusoids(
    timesteps: torch.Tensor,
    dim: int,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
    max_period: float = 10000.0,
) -> torch.Tensor:
    """(batch,) timesteps -> (batch, dim) float32 sinusoidal features (DDPM / Diffusers `get_timestep_embedding`).

    Timesteps may be fractional; each sample has its own, which is what lets the engine batch requests
    that are at different denoising steps. With `flip_sin_to_cos` the cosine half comes first (FLUX, SD3).
    """
    if timesteps.ndim != 1:
        raise ValueError(f"timesteps must be 1-D (batch,), got shape {tuple(timesteps.shape)}")
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / (half - downscale_freq_shift))
    args = timesteps[:, None].float() * freqs[None, :]
    sin, cos = torch.sin(args), torch.cos(args)
    emb = torch.cat([cos, sin] if flip_sin_to_cos else [sin, cos], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class TimestepProjection(nn.Module):
    """Parameter-free module form of `timestep_sinusoids` (Diffusers' `Timesteps`)."""

    def __init__(self, dim: int, flip_sin_to_cos: bool = True, downscale_freq_shift: float = 0.0) -> None:
        super().__init__()
        self.dim = dim
        self.flip_sin_to_cos = flip_sin_to_cos
        self.downscale_freq_shift = downscale_freq_shift

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timestep_sinusoids(timesteps, self.dim, self.flip_sin_to_cos, self.downscale_freq_shift)


class TimestepEmbedding(nn.Module):
    """Two-layer SiLU MLP on sinusoidal features (Diffusers' `TimestepEmbedding` with defaults)."""

    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TextProjection(nn.Module):
    """Two-layer SiLU MLP on the pooled text embedding (Diffusers' `PixArtAlphaTextProjection(act_fn="silu")`)."""

    def __init__(self, in_features: int, hidden_size: int, out_features: int | None = None) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, out_features or hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CombinedTimestepTextEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)) [+ MLP(sinusoids(guidance))] + MLP(pooled text), one vector per sample.

    Diffusers' `CombinedTimestepTextProjEmbeddings` (FLUX.1-schnell, SD3) and, with `guidance_embeds`,
    `CombinedTimestepGuidanceTextProjEmbeddings` (guidance-distilled FLUX.1-dev). The sinusoids are cast
    to the pooled embedding's dtype before the MLPs, and the sum is taken in Diffusers' order.
    """

    def __init__(
        self,
        embedding_dim: int,
        pooled_projection_dim: int,
        guidance_embeds: bool = False,
        num_channels: int = 256,
    ) -> None:
        super().__init__()
        self.time_proj = TimestepProjection(num_channels, flip_sin_to_cos=True, downscale_freq_shift=0.0)
        self.timestep_embedder = TimestepEmbedding(num_channels, embedding_dim)
        self.guidance_embedder = TimestepEmbedding(num_channels, embedding_dim) if guidance_embeds else None
        self.text_embedder = TextProjection(pooled_projection_dim, embedding_dim)

    def forward(
        self, timestep: torch.Tensor, pooled_projection: torch.Tensor, guidance: torch.Tensor | None = None
    ) -> torch.Tensor:
        dtype = pooled_projection.dtype
        emb = self.timestep_embedder(self.time_proj(timestep).to(dtype))
        if self.guidance_embedder is not None:
            if guidance is None:
                raise ValueError(
                    "this model embeds the guidance scale: pass `guidance` (one value per sample)"
                )
            emb = emb + self.guidance_embedder(self.time_proj(guidance).to(dtype))
        elif guidance is not None:
            raise ValueError(
                "this model has no guidance embedding (guidance_embeds=False): pass guidance=None"
            )
        return emb + self.text_embedder(pooled_projection)
