"""FLUX.1 transformer (Black Forest Labs), native, loading Diffusers `FluxTransformer2DModel` weights unchanged.

Architecture (MMDiT + single-stream DiT):

    x   = x_embedder(packed latents)                 (batch, img_seq, inner)
    ctx = context_embedder(T5 states)                (batch, txt_seq, inner)
    temb = MLP(t) [+ MLP(guidance)] + MLP(pooled CLIP) (batch, inner)        one per sample
    rope = tables from [txt_ids; img_ids]             shared by every block
    num_layers x double-stream block: text and image keep separate weights, attend jointly
    num_single_layers x single-stream block: one sequence [ctx; x], parallel attention + MLP
    out = proj_out(adaLN(x, temb))

Every block is conditioned through adaLN on `temb`, which has one row per sample, so one forward can
serve requests at different timesteps (the engine's step-level batching).

Differences from Diffusers that do not change the numbers: SiLU(temb) is computed once per forward
instead of once per block, the single-stream blocks run on one concatenated sequence instead of
concatenating and splitting in every block, and RoPE tables are half width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.attention import attention
from diffserve.layers.embeddings import CombinedTimestepTextEmbedding
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.rotary import RotaryEmbedding, multi_axis_rope_tables
from diffserve.models.config_keys import checked_config_kwargs
from diffserve.models.step_cache import BatchStepCache

RopeTables = tuple[torch.Tensor, torch.Tensor]

#: Diffusers' config keys and defaults (FLUX.1-dev/schnell use these, with `guidance_embeds` on for dev).
FLUX_CONFIG_DEFAULTS: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}

ROPE_THETA = 10000.0
NORM_EPS = 1e-6
# Diffusers' FLUX attention uses torch.nn.RMSNorm for QK-norm (weight multiply in fp32, rounded once);
# see `RMSNorm(round_once=True)`. BFL's original code rounds before the weight; only bf16/fp16 differ.


def _fp16_clip(x: torch.Tensor) -> torch.Tensor:
    """Diffusers clamps the residual stream in fp16 so activation outliers do not become inf."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def _gated_residual(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`residual + gate[:, None] * x`, adding in place into the fresh product (same rounding, one buffer less)."""
    return (gate.unsqueeze(1) * x).add_(residual)


class AdaLayerNormZero(nn.Module):
    """adaLN-Zero for a double-stream block: modulates the attention input, returns the other five vectors.

    `temb_act` is SiLU(temb), computed once per forward by the model.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(temb_act).chunk(6, dim=1)
        x = self.modulate(self.norm(x), scale=scale_msa, shift=shift_msa)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    """adaLN-Zero for a single-stream block: (modulated x, gate)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate = self.linear(temb_act).chunk(3, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift), gate


class AdaLayerNormContinuous(nn.Module):
    """Final adaLN before `proj_out`; note the (scale, shift) order of its projection, unlike adaLN-Zero."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(temb_act.to(x.dtype)).chunk(2, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift)


class GeluProjection(nn.Module):
    """Linear followed by tanh-approximated GELU; a module of its own for the `net.0.proj` weight name."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """dim -> 4*dim -> dim MLP; `net` = [GeluProjection, (dropout slot), Linear] keeps Diffusers' `ff.net.{0,2}` names."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class _QKV(nn.Module):
    """q/k/v projections with per-head RMSNorm on q and k (FLUX's QK-norm), heads split without a copy."""

    def _project(
        self,
        x: torch.Tensor,
        to_q: nn.Linear,
        to_k: nn.Linear,
        to_v: nn.Linear,
        norm_q: RMSNorm,
        norm_k: RMSNorm,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = norm_q(to_q(x).unflatten(-1, (-1, head_dim)))
        k = norm_k(to_k(x).unflatten(-1, (-1, head_dim)))
        v = to_v(x).unflatten(-1, (-1, head_dim))
        return q, k, v


class FluxJointAttention(_QKV):
    """Double-stream attention: text and image have their own projections, attend over [text; image]."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = RMSNorm(head_dim, eps=NORM_EPS, round_once=True)
        self.norm_k = RMSNorm(head_dim, eps=NORM_EPS, round_once=True)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.add_q_proj = nn.Linear(dim, inner)
        self.add_k_proj = nn.Linear(dim, inner)
        self.add_v_proj = nn.Linear(dim, inner)
        self.norm_added_q = RMSNorm(head_dim, eps=NORM_EPS, round_once=True)
        self.norm_added_k = RMSNorm(head_dim, eps=NORM_EPS, round_once=True)
        self.to_add_out = nn.Linear(inner, dim)
        self.rope = RotaryEmbedding()

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self._project(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k, self.head_dim)
        cq, ck, cv = self._project(
            ctx,
            self.add_q_proj,
            self.add_k_proj,
            self.add_v_proj,
            self.norm_added_q,
            self.norm_added_k,
            self.head_dim,
        )
        q, k = self.rope(torch.cat([cq, q], dim=1), torch.cat([ck, k], dim=1), *rope)
        out = attention(q, k, torch.cat([cv, v], dim=1)).flatten(2)
        ctx_out, x_out = out.split([ctx.shape[1], x.shape[1]], dim=1)
        # The split halves are strided views when batch > 1; CPU bf16 matmuls round differently on
        # strided inputs, so make them contiguous as Diffusers does (free when batch == 1).
        return self.to_out[0](x_out.contiguous()), self.to_add_out(ctx_out.contiguous())


class FluxSelfAttention(_QKV):
    """Single-stream attention without an output projection (the block's `proj_out` fuses it with the MLP)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = RMSNorm(head_dim, eps=NORM_EPS, round_once=True)
        self.norm_k = RMSNorm(head_dim, eps=NORM_EPS, round_once=True)
        self.rope = RotaryEmbedding()

    def forward(self, x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        q, k, v = self._project(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k, self.head_dim)
        q, k = self.rope(q, k, *rope)
        return attention(q, k, v).flatten(2)


class FluxTransformerBlock(nn.Module):
    """Double-stream (MMDiT) block: separate adaLN, attention projections and MLPs for text and image."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormZero(dim)
        self.attn = FluxJointAttention(dim, num_heads, head_dim)
        self.norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff = FeedForward(dim)
        self.norm2_context = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff_context = FeedForward(dim)
        self.modulate = Modulate()

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, temb_act: torch.Tensor, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb_act)
        norm_ctx, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(ctx, temb_act)
        attn_x, attn_ctx = self.attn(norm_x, norm_ctx, rope)

        x = _gated_residual(x, gate_msa, attn_x)
        ff_in = self.modulate(self.norm2(x), scale=scale_mlp, shift=shift_mlp)
        x = _gated_residual(x, gate_mlp, self.ff(ff_in))

        ctx = _gated_residual(ctx, c_gate_msa, attn_ctx)
        ff_in = self.modulate(self.norm2_context(ctx), scale=c_scale_mlp, shift=c_shift_mlp)
        ctx = _gated_residual(ctx, c_gate_mlp, self.ff_context(ff_in))
        return _fp16_clip(ctx), x


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block on [text; image]: attention and MLP run in parallel from one adaLN input."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        mlp_dim = int(dim * mlp_ratio)
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, mlp_dim)
        self.attn = FluxSelfAttention(dim, num_heads, head_dim)
        self.proj_out = nn.Linear(dim + mlp_dim, dim)

    def forward(self, h: torch.Tensor, temb_act: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        norm_h, gate = self.norm(h, temb_act)
        mlp = F.gelu(self.proj_mlp(norm_h), approximate="tanh")
        attn = self.attn(norm_h, rope)
        out = self.proj_out(torch.cat([attn, mlp], dim=2))
        return _fp16_clip(_gated_residual(h, gate, out))


class FluxTransformer2DModel(nn.Module):
    """FLUX.1 DiT with Diffusers' config keys and state-dict names.

    Build it with keyword config values (or `from_config(config_json_dict)`); under
    `torch.device("meta")` it allocates nothing, and `load_state_dict(sd, assign=True, strict=True)`
    fills it. It holds no buffers and computes nothing from parameter values at construction.
    """

    diffusers_class_name: ClassVar[str] = "FluxTransformer2DModel"

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        guidance_embeds: bool = False,
        axes_dims_rope: Sequence[int] = (16, 56, 56),
    ) -> None:
        super().__init__()
        axes_dims_rope = tuple(int(d) for d in axes_dims_rope)
        if sum(axes_dims_rope) != attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {axes_dims_rope} must sum to attention_head_dim ({attention_head_dim})"
            )
        if any(d % 2 for d in axes_dims_rope):
            raise ValueError(f"every entry of axes_dims_rope must be even, got {axes_dims_rope}")
        out_channels = out_channels or in_channels
        self.config: dict[str, Any] = {
            "patch_size": patch_size,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "num_layers": num_layers,
            "num_single_layers": num_single_layers,
            "attention_head_dim": attention_head_dim,
            "num_attention_heads": num_attention_heads,
            "joint_attention_dim": joint_attention_dim,
            "pooled_projection_dim": pooled_projection_dim,
            "guidance_embeds": guidance_embeds,
            "axes_dims_rope": axes_dims_rope,
        }
        self.axes_dims_rope = axes_dims_rope
        self.guidance_embeds = guidance_embeds
        self.out_channels = out_channels
        inner = num_attention_heads * attention_head_dim
        self.inner_dim = inner

        self.time_text_embed = CombinedTimestepTextEmbedding(inner, pooled_projection_dim, guidance_embeds)
        self.context_embedder = nn.Linear(joint_attention_dim, inner)
        self.x_embedder = nn.Linear(in_channels, inner)
        self.transformer_blocks = nn.ModuleList(
            [FluxTransformerBlock(inner, num_attention_heads, attention_head_dim) for _ in range(num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [
                FluxSingleTransformerBlock(inner, num_attention_heads, attention_head_dim)
                for _ in range(num_single_layers)
            ]
        )
        self.norm_out = AdaLayerNormContinuous(inner)
        self.proj_out = nn.Linear(inner, patch_size * patch_size * out_channels)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FluxTransformer2DModel:
        """Build from a Diffusers `config.json` dict; `_`-prefixed metadata keys are ignored, unknown keys are an error."""
        return cls(**checked_config_kwargs(config, FLUX_CONFIG_DEFAULTS, cls.diffusers_class_name))

    def rope_tables(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> RopeTables:
        """Half-width (cos, sin) tables for the joint sequence [text; image].

        They depend only on the ids, i.e. on the request's shape; a caller that runs many steps (or
        many same-shape requests) can compute them once and pass them to `forward(rope=...)`.
        """
        for name, ids in (("txt_ids", txt_ids), ("img_ids", img_ids)):
            if ids.ndim != 2:
                raise ValueError(
                    f"{name} must be 2-D (seq, {len(self.axes_dims_rope)}), got {tuple(ids.shape)}"
                )
        return multi_axis_rope_tables(torch.cat([txt_ids, img_ids], dim=0), self.axes_dims_rope, ROPE_THETA)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        rope: RopeTables | None = None,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for packed latents.

        Args:
            hidden_states: packed image latents (batch, img_seq, in_channels).
            encoder_hidden_states: T5 states (batch, txt_seq, joint_attention_dim).
            pooled_projections: pooled CLIP embedding (batch, pooled_projection_dim).
            timestep: (batch,) or (1,) in [0, 1] (sigma); scaled by 1000 here, as in Diffusers.
            img_ids, txt_ids: position ids (img_seq, 3) and (txt_seq, 3), shared by the batch.
            guidance: (batch,) or (1,) guidance scale for guidance-distilled models, else None.
            rope: precomputed `rope_tables(txt_ids, img_ids)`; computed from the ids when None.
            step_cache: rows of approximate-quality requests, which may reuse the blocks' residual from
                an earlier step (`models/step_cache.py`); None runs every block for every row (exact).

        Returns:
            (batch, img_seq, patch_size**2 * out_channels).
        """
        batch = hidden_states.shape[0]
        for name, t in (("timestep", timestep), ("guidance", guidance)):
            if t is not None and (t.ndim != 1 or t.shape[0] not in (1, batch)):
                raise ValueError(f"{name} must have shape ({batch},) or (1,), got {tuple(t.shape)}")
        if rope is None:
            rope = self.rope_tables(txt_ids, img_ids)

        x = self.x_embedder(hidden_states)
        # Rounded to the activation dtype before scaling, as Diffusers does (it matters in bf16).
        timestep = timestep.to(x.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(x.dtype) * 1000
        temb = self.time_text_embed(timestep, pooled_projections, guidance)
        temb_act = F.silu(temb)  # every adaLN projects SiLU(temb); compute it once
        ctx = self.context_embedder(encoder_hidden_states)

        if step_cache is None:
            x = self._run_blocks(x, ctx, temb_act, rope)
        else:
            x = step_cache.run(
                x,
                self._cache_signal(x, temb_act),
                lambda rows: self._run_blocks(
                    _take_rows(x, rows), _take_rows(ctx, rows), _take_rows(temb_act, rows), rope
                ),
            )
        x = self.norm_out(x, temb_act)
        return self.proj_out(x)

    def _run_blocks(
        self, x: torch.Tensor, ctx: torch.Tensor, temb_act: torch.Tensor, rope: RopeTables
    ) -> torch.Tensor:
        """Every double- and single-stream block; returns the image tokens the output head reads."""
        for block in self.transformer_blocks:
            ctx, x = block(x, ctx, temb_act, rope)
        txt_len = ctx.shape[1]
        h = torch.cat([ctx, x], dim=1)
        for block in self.single_transformer_blocks:
            h = block(h, temb_act, rope)
        return h[:, txt_len:]

    def _cache_signal(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        """The first block's timestep-modulated image input: what the step cache watches change."""
        if len(self.transformer_blocks):
            return self.transformer_blocks[0].norm1(x, temb_act)[0]
        return self.single_transformer_blocks[0].norm(x, temb_act)[0]


def _take_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`t` restricted to batch rows `rows` (None: all); a 1-row tensor broadcast over the batch stays."""
    return t if rows is None or t.shape[0] == 1 else t.index_select(0, rows)
