"""Conditioning embedders of the HunyuanVideo 1.5 DiT (`models/dits/hunyuan_video15.py`), with Diffusers'
module and parameter names:

    time_embed        timestep (and MeanFlow's second timestep) -> temb           (batch, inner)
    context_embedder  Qwen2.5-VL states -> a small timestep-conditioned transformer  (batch, txt, inner)
    context_embedder_2  ByT5 glyph states -> LN + 3-layer GELU MLP                  (batch, glyph, inner)
    image_embedder    SigLIP image states -> LN, GELU MLP, LN                      (batch, img, inner)

The token refiner (`context_embedder`) pools the text over its mask, embeds that with the timestep,
and runs `num_refiner_layers` pre-LN self-attention blocks whose two residual gates come from that
embedding. Its padding is a key mask: a padded query row gets a finite value Diffusers would not (it
masks rows and columns), but no padded text token ever reaches the video stream, so the DiT's output
is the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.attention import attention
from diffserve.layers.attention_weights import AttentionWeights
from diffserve.layers.embeddings import CombinedTimestepTextEmbedding, TimestepEmbedding, timestep_sinusoids
from diffserve.layers.norms import LayerNorm

#: Sinusoid width of every timestep embedding in the model.
TIMESTEP_CHANNELS = 256
#: The refiner's LayerNorms; the ByT5 and image projections use torch's default 1e-5.
REFINER_NORM_EPS = 1e-6
TORCH_LAYER_NORM_EPS = 1e-5
#: The refiner's MLP ratio: Diffusers builds the refiner with its default, not the config's `mlp_ratio`.
REFINER_MLP_RATIO = 4.0
#: Hidden width of the ByT5 projection, fixed in the architecture.
BYT5_PROJECTION_HIDDEN = 2048


def timestep_embedding(
    embedder: TimestepEmbedding, timestep: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """MLP(sinusoids(timestep)). The sinusoids are rounded to `dtype` first when it is a floating dtype
    (Diffusers rounds them to the main timestep's dtype, so a bf16 timestep gives bf16-rounded features),
    then fed in the weights' dtype."""
    features = timestep_sinusoids(timestep, TIMESTEP_CHANNELS)
    if dtype.is_floating_point:
        features = features.to(dtype)
    return embedder(features.to(embedder.linear_1.weight.dtype))


class HunyuanVideo15TimeEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)) [+ MLP_r(sinusoids(t_r))]; the second term only for MeanFlow checkpoints
    (`use_meanflow`, step-distilled / super-resolution), which pass the next step's timestep as t_r."""

    def __init__(self, embedding_dim: int, use_meanflow: bool = False) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, embedding_dim)
        self.timestep_embedder_r = (
            TimestepEmbedding(TIMESTEP_CHANNELS, embedding_dim) if use_meanflow else None
        )

    def forward(self, timestep: torch.Tensor, timestep_r: torch.Tensor | None = None) -> torch.Tensor:
        emb = timestep_embedding(self.timestep_embedder, timestep, timestep.dtype)
        if timestep_r is None:
            return emb
        if self.timestep_embedder_r is None:
            raise ValueError(
                "timestep_r is only for MeanFlow models (use_meanflow=True); pass timestep_r=None"
            )
        return emb + timestep_embedding(self.timestep_embedder_r, timestep_r, timestep.dtype)


class SiluProjection(nn.Module):
    """Linear then SiLU; `proj` keeps Diffusers' `net.0.proj` weight name (its `LinearActivation`)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(x))


class SiluFeedForward(nn.Module):
    """dim -> inner -> dim with a SiLU (Diffusers' `FeedForward(activation_fn="linear-silu")`); `net.1`
    stands for the dropout so the output layer keeps the `net.2` name."""

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([SiluProjection(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class RefinerSelfAttention(AttentionWeights):
    """Plain multi-head self-attention with biases and no QK-norm (Diffusers' default `Attention`)."""

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)) for proj in (self.to_q, self.to_k, self.to_v))
        return self.to_out[0](attention(q, k, v, key_mask).flatten(2))


class RefinerGates(nn.Module):
    """The refiner block's two residual gates from temb: Linear(SiLU(temb)) split in (attention, MLP)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_msa, gate_mlp = self.linear(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
        return gate_msa, gate_mlp


class HunyuanVideo15IndividualTokenRefinerBlock(nn.Module):
    """x += gate_msa * attn(LN(x)); x += gate_mlp * MLP_silu(LN(x)); gates from the pooled-text temb."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        dim = num_heads * head_dim
        self.norm1 = LayerNorm(dim, eps=REFINER_NORM_EPS)
        self.attn = RefinerSelfAttention(dim, num_heads, head_dim)
        self.norm2 = LayerNorm(dim, eps=REFINER_NORM_EPS)
        self.ff = SiluFeedForward(dim, int(dim * REFINER_MLP_RATIO))
        self.norm_out = RefinerGates(dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        gate_msa, gate_mlp = self.norm_out(temb)
        x = x + self.attn(self.norm1(x), key_mask) * gate_msa
        return x + self.ff(self.norm2(x)) * gate_mlp


class HunyuanVideo15IndividualTokenRefiner(nn.Module):
    """The refiner's stack of blocks (Diffusers' `token_refiner.refiner_blocks`)."""

    def __init__(self, num_heads: int, head_dim: int, num_layers: int) -> None:
        super().__init__()
        self.refiner_blocks = nn.ModuleList(
            [HunyuanVideo15IndividualTokenRefinerBlock(num_heads, head_dim) for _ in range(num_layers)]
        )

    def forward(self, x: torch.Tensor, temb: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        for block in self.refiner_blocks:
            x = block(x, temb, key_mask)
        return x


class HunyuanVideo15TokenRefiner(nn.Module):
    """Qwen2.5-VL states (batch, txt, text_embed_dim) and their mask -> refined text tokens (batch, txt, inner).

    The refiner's temb is MLP(sinusoids(t)) + MLP(mean of the unpadded text states), its own, not the
    DiT's. Padded tokens are masked as keys only (module docstring).
    """

    def __init__(self, in_channels: int, num_heads: int, head_dim: int, num_layers: int) -> None:
        super().__init__()
        dim = num_heads * head_dim
        self.time_text_embed = CombinedTimestepTextEmbedding(dim, in_channels, num_channels=TIMESTEP_CHANNELS)
        self.proj_in = nn.Linear(in_channels, dim)
        self.token_refiner = HunyuanVideo15IndividualTokenRefiner(num_heads, head_dim, num_layers)

    def forward(self, states: torch.Tensor, timestep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`mask` (batch, txt) bool, true for real tokens."""
        weights = mask.float().unsqueeze(-1)
        pooled = ((states * weights).sum(dim=1) / weights.sum(dim=1)).to(states.dtype)
        temb = self.time_text_embed(timestep, pooled)
        key_mask = mask[:, None, None, :]
        return self.token_refiner(self.proj_in(states), temb, key_mask)


class HunyuanVideo15ByT5TextProjection(nn.Module):
    """ByT5 glyph states -> model width: LN, Linear, GELU, Linear, GELU, Linear (exact GELU)."""

    def __init__(self, in_features: int, hidden_size: int, out_features: int) -> None:
        super().__init__()
        self.norm = LayerNorm(in_features, eps=TORCH_LAYER_NORM_EPS)
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)
        self.linear_3 = nn.Linear(hidden_size, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.linear_1(self.norm(x)))
        return self.linear_3(F.gelu(self.linear_2(x)))


class HunyuanVideo15ImageProjection(nn.Module):
    """SigLIP image states -> model width: LN, Linear, GELU, Linear, LN (exact GELU, affine LNs)."""

    def __init__(self, in_channels: int, hidden_size: int) -> None:
        super().__init__()
        self.norm_in = LayerNorm(in_channels, eps=TORCH_LAYER_NORM_EPS)
        self.linear_1 = nn.Linear(in_channels, in_channels)
        self.linear_2 = nn.Linear(in_channels, hidden_size)
        self.norm_out = LayerNorm(hidden_size, eps=TORCH_LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_out(self.linear_2(F.gelu(self.linear_1(self.norm_in(x)))))
