"""Conditioning embeddings shared by DiTs (timestep sinusoids, their MLP, pooled-text and caption
projections), with Diffusers' parameter names."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.mlp import gelu_in_place


def timestep_sinusoids(
    timesteps: torch.Tensor,
    dim: int,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
    max_period: float = 10000.0,
) -> torch.Tensor:
    """(batch,) timesteps, one per sample (so requests at different steps batch) -> (batch, dim) float32
    sinusoids, as Diffusers' `get_timestep_embedding`; `flip_sin_to_cos`: cosines first."""
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


class TextProjection(nn.Module):
    """Two-layer SiLU MLP on the pooled text embedding (Diffusers' `PixArtAlphaTextProjection(act_fn="silu")`)."""

    def __init__(self, in_features: int, hidden_size: int, out_features: int | None = None) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, out_features or hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class GeluTanhTextProjection(nn.Module):
    """Two-layer tanh-GELU MLP mapping text-encoder states to a DiT's width (Diffusers'
    `PixArtAlphaTextProjection`, its default `act_fn="gelu_tanh"`): Wan's UMT5, LTX-2's Gemma-3 and
    SANA's Gemma-2 caption projections. The GELU is written over the first Linear's fresh output."""

    def __init__(self, in_features: int, hidden_size: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(gelu_in_place(self.linear_1(x), "tanh"))


class TimestepEmbedding(TextProjection):
    """The same MLP on sinusoidal features (Diffusers' `TimestepEmbedding` with defaults)."""

    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__(in_channels, time_embed_dim)


class CombinedTimestepTextEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)) [+ MLP(sinusoids(guidance))] + MLP(pooled text), in Diffusers' order and
    dtypes: `CombinedTimestep[Guidance]TextProjEmbeddings` (FLUX.1, SD3)."""

    def __init__(
        self,
        embedding_dim: int,
        pooled_projection_dim: int,
        guidance_embeds: bool = False,
        num_channels: int = 256,
    ) -> None:
        super().__init__()
        self.num_channels = num_channels
        self.timestep_embedder = TimestepEmbedding(num_channels, embedding_dim)
        self.guidance_embedder = TimestepEmbedding(num_channels, embedding_dim) if guidance_embeds else None
        self.text_embedder = TextProjection(pooled_projection_dim, embedding_dim)

    def forward(
        self, timestep: torch.Tensor, pooled_projection: torch.Tensor, guidance: torch.Tensor | None = None
    ) -> torch.Tensor:
        dtype = pooled_projection.dtype
        emb = self.timestep_embedder(timestep_sinusoids(timestep, self.num_channels).to(dtype))
        if self.guidance_embedder is not None:
            if guidance is None:
                raise ValueError(
                    "this model embeds the guidance scale: pass `guidance` (one value per sample)"
                )
            emb = emb + self.guidance_embedder(timestep_sinusoids(guidance, self.num_channels).to(dtype))
        elif guidance is not None:
            raise ValueError(
                "this model has no guidance embedding (guidance_embeds=False): pass guidance=None"
            )
        return emb + self.text_embedder(pooled_projection)
