"""HunyuanVideo (1.0) video transformer (Tencent Hunyuan), native, loading Diffusers
`HunyuanVideoTransformer3DModel` weights unchanged.

Architecture (MMDiT over spatio-temporal patches: double-stream blocks, then single-stream blocks):

    x    = x_embedder(latents)                 Conv3d, stride = patch (patch_size_t, patch_size, patch_size)
    temb = MLP(sinusoids(t)) [+ MLP(sinusoids(guidance))] + MLP(CLIP pooled text)        (batch, inner)
    ctx  = token refiner(Llama states, t, mask)                                        (batch, txt, inner)
    num_layers x double block:        adaLN-Zero per stream, joint attention over [video; ctx]
    num_single_layers x single block: one adaLN-Zero over [video; ctx], attention and tanh-GELU MLP in
                                      parallel, one output projection
    out  = unpatchify(proj_out(adaLN(x, temb)))                          (batch, out_channels, F, H, W)

RoPE rotates the video queries and keys only (per-head RMSNorm on q and k first), with the same
(frame, row, column) tables as HunyuanVideo 1.5 (`hunyuan_video15_rope_tables`). The double-stream block
and the token refiner's layers are HunyuanVideo 1.5's (same maths and weight names); what differs is here:
the single-stream blocks, the guidance embedding and the refiner's mask.

Text mask. Diffusers masks, in every block, the context keys at positions >= the row's count of valid
tokens (it assumes right padding); the refiner's self-attention masks query and key rows by the mask
itself, always letting every query see token 0. Both are kept: the refiner runs the full (txt, txt) mask,
and the blocks' key mask is built from the counts. Keys past the longest row's count are masked in every
row, so the context is cut there (the same output, a shorter attention; a batch whose rows all count the
same runs without a mask). The cut reads the counts on the host (one sync per forward).

Differences from Diffusers' forward that do not change the numbers for the inputs its pipeline passes:
- Latents whose frame or spatial size is not a multiple of the patch size are rejected, not cropped.
- `forward` returns the sample tensor itself (Diffusers' `return_dict=False` gives `(sample,)`).
- `qk_norm` other than "rms_norm" (the released checkpoints' value) is rejected, and so is an
  `image_condition_type` (the image-to-video checkpoints, whose pipeline is not served natively yet).

Not implemented yet: sequence and tensor parallelism and the step cache (the model is refused for them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.adaln import AdaLayerNormContinuous
from diffserve.layers.attention import attention
from diffserve.layers.embeddings import CombinedTimestepTextEmbedding
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.patches import video_patch_grid
from diffserve.layers.residual import gated_residual
from diffserve.layers.rotary import RopeTables, RotaryEmbedding, checked_rope_axes
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.hunyuan_video15 import (
    HunyuanVideo15PatchEmbed,
    HunyuanVideo15TransformerBlock,
    hunyuan_video15_rope_tables,
)
from diffserve.models.dits.hunyuan_video15_embedders import HunyuanVideo15TokenRefiner

NORM_EPS = 1e-6
#: RoPE tables kept per (grid, device); a server sees a handful of video sizes.
ROPE_CACHE_SIZE = 16


@dataclass(frozen=True)
class HunyuanVideoTransformerConfig(DiTConfig):
    """The HunyuanVideo DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are Diffusers' (the released 13B text-to-video model: 24 heads x 128, 20 double and 40
    single blocks, guidance-distilled). `out_channels` None means `in_channels`; `rope_axes_dim` becomes
    a tuple.
    """

    in_channels: int = 16
    out_channels: int | None = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    image_condition_type: str | None = None

    def __post_init__(self) -> None:
        if self.qk_norm != "rms_norm":
            raise ValueError(f"qk_norm {self.qk_norm!r} is not supported; HunyuanVideo uses 'rms_norm'")
        if self.image_condition_type is not None:
            raise ValueError(
                f"image_condition_type {self.image_condition_type!r} (a HunyuanVideo image-to-video DiT) is "
                "not supported natively yet; only text-to-video checkpoints (None) are"
            )
        rope_axes_dim = checked_rope_axes("rope_axes_dim", self.rope_axes_dim, self.attention_head_dim, 3)
        self._normalise(rope_axes_dim=rope_axes_dim, out_channels=self.out_channels or self.in_channels)

    @property
    def patch(self) -> tuple[int, int, int]:
        """(frames, height, width) patch size of the latent grid."""
        return self.patch_size_t, self.patch_size, self.patch_size


class HunyuanVideoTokenRefiner(HunyuanVideo15TokenRefiner):
    """The Llama states' refiner (`context_embedder`), with Diffusers' HunyuanVideo mask: a query row of a
    valid token sees the valid keys, a padded one sees nothing but it; both always see token 0."""

    def forward(self, states: torch.Tensor, timestep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`mask` (batch, txt) bool, true for real tokens."""
        weights = mask.float().unsqueeze(-1)
        pooled = ((states * weights).sum(dim=1) / weights.sum(dim=1)).to(states.dtype)
        temb = self.time_text_embed(timestep, pooled)
        pairs = mask[:, None, :, None] & mask[:, None, None, :]
        pairs[..., 0] = True
        return self.token_refiner(self.proj_in(states), temb, pairs)


class HunyuanVideoSelfAttention(nn.Module):
    """The single-stream block's attention weights (Diffusers' `Attention(pre_only=True)`: no output
    projection) and its per-head RMSNorms; RoPE on the leading video tokens only."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = RMSNorm(head_dim, eps=NORM_EPS)
        self.norm_k = RMSNorm(head_dim, eps=NORM_EPS)
        self.rope = RotaryEmbedding()

    def forward(
        self, h: torch.Tensor, video_len: int, rope: RopeTables, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention over [video; ctx] `h` (batch, seq, dim); returns (batch, seq, inner)."""
        q, k, v = (proj(h).unflatten(-1, (-1, self.head_dim)) for proj in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        q_video, k_video = self.rope(q[:, :video_len], k[:, :video_len], *rope)
        q = torch.cat([q_video, q[:, video_len:]], dim=1)
        k = torch.cat([k_video, k[:, video_len:]], dim=1)
        return attention(q, k, v, key_mask).flatten(2)


class HunyuanVideoSingleTransformerBlock(nn.Module):
    """Single-stream block on [video; ctx]: h + gate * proj_out([attention(x); GELU_tanh(proj_mlp(x))]),
    x the adaLN-Zero-modulated h."""

    def __init__(self, num_heads: int, head_dim: int, mlp_ratio: float) -> None:
        super().__init__()
        dim = num_heads * head_dim
        mlp_dim = int(dim * mlp_ratio)
        self.attn = HunyuanVideoSelfAttention(dim, num_heads, head_dim)
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, mlp_dim)
        self.proj_out = nn.Linear(dim + mlp_dim, dim)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        temb_act: torch.Tensor,
        rope: RopeTables,
        key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video, context) after the block; `temb_act` = SiLU(temb), (batch, inner)."""
        video_len = x.shape[1]
        h = torch.cat([x, ctx], dim=1)
        norm_h, gate = self.norm(h, temb_act)
        mlp = F.gelu(self.proj_mlp(norm_h), approximate="tanh")
        attn = self.attn(norm_h, video_len, rope, key_mask)
        h = gated_residual(h, gate.unsqueeze(1), self.proj_out(torch.cat([attn, mlp], dim=2)))
        return h[:, :video_len], h[:, video_len:]


class AdaLayerNormZeroSingle(nn.Module):
    """adaLN-Zero of a single-stream block: Linear(SiLU(temb)) -> (shift, scale, gate); returns the
    modulated input and the gate."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate = self.linear(temb_act).chunk(3, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift), gate


class HunyuanVideoTransformer3DModel(DiffusersDiT):
    """HunyuanVideo text-to-video DiT with Diffusers' config keys and state-dict names.

    Built from a `HunyuanVideoTransformerConfig` (`DiffusersDiT`). It holds no buffers; RoPE tables are
    built on first use per latent grid and cached.
    """

    diffusers_class_name: ClassVar[str] = "HunyuanVideoTransformer3DModel"
    config_class = HunyuanVideoTransformerConfig
    #: Its forward runs whole on one device: sequence parallelism is refused at load.
    sequence_parallel: ClassVar[bool] = False

    def __init__(self, config: HunyuanVideoTransformerConfig) -> None:
        super().__init__(config)
        inner, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache(ROPE_CACHE_SIZE)

        self.x_embedder = HunyuanVideo15PatchEmbed(config.in_channels, inner, config.patch)
        self.context_embedder = HunyuanVideoTokenRefiner(
            config.text_embed_dim, heads, head_dim, config.num_refiner_layers
        )
        self.time_text_embed = CombinedTimestepTextEmbedding(
            inner, config.pooled_projection_dim, guidance_embeds=config.guidance_embeds
        )
        self.transformer_blocks = nn.ModuleList(
            [
                HunyuanVideo15TransformerBlock(heads, head_dim, config.mlp_ratio)
                for _ in range(config.num_layers)
            ]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [
                HunyuanVideoSingleTransformerBlock(heads, head_dim, config.mlp_ratio)
                for _ in range(config.num_single_layers)
            ]
        )
        self.norm_out = AdaLayerNormContinuous(inner, eps=NORM_EPS)
        self.proj_out = nn.Linear(inner, math.prod(config.patch) * config.out_channels)

    def rope_tables(self, frames: int, height: int, width: int, device: torch.device) -> RopeTables:
        """Half-width (cos, sin) float32 tables for a post-patch grid, cached per grid and device."""
        return self._rope_cache.get_or_build(
            (frames, height, width),
            device,
            lambda: hunyuan_video15_rope_tables(
                frames, height, width, self.config.rope_axes_dim, self.config.rope_theta, device
            ),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        pooled_projections: torch.Tensor,
        guidance: torch.Tensor | None = None,
        attention_kwargs: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for video latents (Diffusers' keyword arguments).

        Args:
            hidden_states: (batch, in_channels, frames, height, width) noisy latents.
            timestep: (batch,) or (1,) scheduler timesteps in [0, 1000], one per row (rows may be at
                different steps).
            encoder_hidden_states: Llama states (batch, txt, text_embed_dim).
            encoder_attention_mask: (batch, txt) bool / int / float, nonzero for real tokens.
            pooled_projections: CLIP's pooled text (batch, pooled_projection_dim).
            guidance: (batch,) embedded guidance (the pipeline's guidance_scale * 1000); required exactly
                when the config has `guidance_embeds`.
            attention_kwargs: accepted for call compatibility; must be None or empty.

        Returns:
            The velocity (batch, out_channels, frames, height, width) in the activations' dtype.
        """
        if attention_kwargs:
            raise ValueError(
                f"attention_kwargs {sorted(attention_kwargs)} are not supported; pass None (LoRA is applied at load)"
            )
        grid = video_patch_grid(hidden_states, self.config.patch)
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch
        timestep = _rows("timestep", timestep, batch)
        if guidance is not None:
            guidance = _rows("guidance", guidance, batch)
        _check_text(encoder_hidden_states, encoder_attention_mask, pooled_projections, batch)

        rope = self.rope_tables(*grid, hidden_states.device)
        temb = self.time_text_embed(timestep, pooled_projections, guidance)
        x = self.x_embedder(hidden_states)
        text_mask = encoder_attention_mask.bool()
        ctx = self.context_embedder(encoder_hidden_states, timestep, text_mask)
        ctx, key_mask = _cut_context(ctx, encoder_attention_mask, x.shape[1])

        temb_act = F.silu(temb)
        for block in self.transformer_blocks:
            x, ctx = block(x, ctx, temb_act, rope, key_mask)
        for block in self.single_transformer_blocks:
            x, ctx = block(x, ctx, temb_act, rope, key_mask)

        x = self.proj_out(self.norm_out(x, temb_act))
        # (batch, F', H', W', C, p_t, p_h, p_w) -> (batch, C, F'*p_t, H'*p_h, W'*p_w)
        x = x.reshape(batch, *grid, -1, p_t, p_h, p_w).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(batch, -1, frames, height, width)


def _cut_context(
    ctx: torch.Tensor, mask: torch.Tensor, video_len: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The context cut after the longest row's count of valid tokens, and the (batch, 1, 1, video + ctx)
    key mask of Diffusers' (positions past a row's count masked), None when no row is masked."""
    counts = mask.sum(dim=1, dtype=torch.int)
    longest, shortest = (int(n) for n in torch.stack([counts.max(), counts.min()]).tolist())
    ctx = ctx[:, :longest]
    if shortest == longest:
        return ctx, None
    text_keys = torch.arange(longest, device=ctx.device)[None, :] < counts[:, None]
    video_keys = text_keys.new_ones(ctx.shape[0], video_len)
    return ctx, torch.cat([video_keys, text_keys], dim=1)[:, None, None, :]


def _check_text(states: torch.Tensor, mask: torch.Tensor, pooled: torch.Tensor, batch: int) -> None:
    """Llama states (batch, txt, dim) with a (batch, txt) mask, and (batch, dim) pooled CLIP text."""
    if states.ndim != 3 or states.shape[0] != batch:
        raise ValueError(
            f"encoder_hidden_states must be (batch={batch}, tokens, dim), got {tuple(states.shape)}"
        )
    if tuple(mask.shape) != tuple(states.shape[:2]):
        raise ValueError(
            f"encoder_attention_mask must be {tuple(states.shape[:2])} (batch, tokens), got {tuple(mask.shape)}"
        )
    if pooled.ndim != 2 or pooled.shape[0] != batch:
        raise ValueError(f"pooled_projections must be (batch={batch}, dim), got {tuple(pooled.shape)}")


def _rows(name: str, values: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-row values as (batch,): one per row, or one for the whole batch."""
    if values.ndim == 0:
        values = values.reshape(1)
    if values.ndim == 1 and values.shape[0] in (1, batch):
        return values.expand(batch)
    raise ValueError(f"{name} must have shape ({batch},) or (1,), got {tuple(values.shape)}")
