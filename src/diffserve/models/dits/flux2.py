"""FLUX.2 transformer (Black Forest Labs), native: loads Diffusers `Flux2Transformer2DModel` weights as is.

Architecture (MMDiT + single-stream DiT, like FLUX.1, with model-level modulation):

    x    = x_embedder(packed latents [+ reference-image tokens])   (batch, img_seq, inner)
    ctx  = context_embedder(text-encoder states)                    (batch, txt_seq, inner)
    temb = MLP(t) [+ MLP(guidance)]                                  (batch, inner)   one per sample
    mods = double_img(SiLU temb), double_txt(SiLU temb), single(SiLU temb)   shared by *all* blocks
    rope = tables from [txt_ids; img_ids], 4 axes (T, H, W, L)       shared by every block
    num_layers x double-stream block: text and image keep separate weights, attend jointly
    num_single_layers x single-stream block: one sequence [ctx; x], attention and SwiGLU MLP in parallel
    out  = proj_out(adaLN(x, temb))

Differences from FLUX.1 that the maths follows Diffusers on: no pooled-text embedding; every block of a
kind reads the *same* shift/scale/gate vectors (three model-level projections instead of one per
block); the MLPs are SwiGLU (`linear_in` gives [gate; up], `SiLU(gate) * up`, `linear_out`), the
single-stream block's q/k/v and MLP input are one checkpoint Linear (`attn.to_qkv_mlp_proj`) and its
attention and MLP outputs one (`attn.to_out`); every Linear is bias-free; RoPE has 4 axes and its own
theta (`rope_theta`, 2000 for the released models).

Every modulation has one row per sample, so one forward can serve requests at different timesteps
(the engine's step-level batching). Differences from Diffusers that do not change the numbers:
SiLU(temb) is computed once per forward, the single-stream blocks run on one concatenated sequence,
and the RoPE tables are half width. Not implemented: Diffusers' Klein KV-cache modes
(`kv_cache_mode`, reference tokens attending only to themselves), tensor and sequence parallelism
(with several ranks each rank runs the whole model) and projection fusion (the checkpoint's
single-stream projections are already fused).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.layers.attention import attention
from diffserve.layers.attention_reuse import ReusableAttention
from diffserve.layers.embeddings import timestep_sinusoids
from diffserve.layers.joint_attention import RotaryJointAttention
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.residual import attention_mlp_residuals, fp16_clip, gated_residual
from diffserve.layers.rotary import RopeTables, RotaryEmbedding, checked_rope_axes, multi_axis_rope_tables
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.flux_block_range import FluxBlockRange
from diffserve.models.dits.input_checks import check_one_text_input, check_per_sample
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows

#: Number of position axes of FLUX.2's ids: (T, H, W, L).
ROPE_AXES = 4


@dataclass(frozen=True)
class Flux2TransformerConfig(DiTConfig):
    """The FLUX.2 DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are Diffusers' (FLUX.2-dev's). `out_channels` None means `in_channels` and is
    resolved when the config is built; sequences become tuples. Klein checkpoints set
    `guidance_embeds` False.
    """

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True

    def __post_init__(self) -> None:
        # Four axes: (T, H, W, L).
        axes = checked_rope_axes("axes_dims_rope", self.axes_dims_rope, self.attention_head_dim, ROPE_AXES)
        self._normalise(axes_dims_rope=axes, out_channels=self.out_channels or self.in_channels)

    @property
    def mlp_hidden_dim(self) -> int:
        """The SwiGLU MLPs' hidden width (their input projections produce twice this)."""
        return int(self.inner_dim * self.mlp_ratio)


# ---------------------------------------------------------------------------------------- layers


def _qk_norm(head_dim: int, eps: float) -> RMSNorm:
    """Diffusers' FLUX.2 attention uses torch.nn.RMSNorm for QK-norm: one rounding at the end."""
    return RMSNorm(head_dim, eps=eps, round_once=True)


def _plain_norm(dim: int, eps: float) -> LayerNorm:
    """The parameter-free LayerNorm in front of every modulation."""
    return LayerNorm(dim, eps=eps, elementwise_affine=False)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`SiLU(first half) * second half` of the last dimension (Diffusers' `Flux2SwiGLU`)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class Flux2FeedForward(nn.Module):
    """SwiGLU MLP: `linear_in` (dim -> 2 * hidden, [gate; up]), SiLU(gate) * up, `linear_out`; no biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.linear_out = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(swiglu(self.linear_in(x)))


class Flux2TimestepEmbedding(nn.Module):
    """Bias-free two-layer SiLU MLP on timestep sinusoids (Diffusers' `TimestepEmbedding`,
    `sample_proj_bias=False`)."""

    def __init__(self, in_channels: int, embedding_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, embedding_dim, bias=False)
        self.linear_2 = nn.Linear(embedding_dim, embedding_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class Flux2TimestepGuidanceEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)) [+ MLP(sinusoids(guidance))], sinusoids rounded to `t`'s dtype first.

    A model without `guidance_embedder` must get guidance None and one with it a guidance value:
    Diffusers silently drops either mismatch; here it is an error, as it means the caller's schedule
    does not fit the checkpoint. The one exception is explicit: `skip_guidance_embedder` leaves a
    checkpoint's guidance embedder out, as Diffusers' Flux2KleinPipeline does (it passes no guidance to
    any FLUX.2 DiT, so a klein folder whose DiT has `guidance_embeds` runs on the timestep alone).
    """

    def __init__(self, in_channels: int, embedding_dim: int, guidance_embeds: bool) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.timestep_embedder = Flux2TimestepEmbedding(in_channels, embedding_dim)
        self.guidance_embedder = (
            Flux2TimestepEmbedding(in_channels, embedding_dim) if guidance_embeds else None
        )

    def forward(
        self, timestep: torch.Tensor, guidance: torch.Tensor | None, skip_guidance_embedder: bool = False
    ) -> torch.Tensor:
        """`timestep`, `guidance`: (batch,) or (1,), already scaled to [0, 1000], in the activation dtype.
        `skip_guidance_embedder`: the timestep's embedding only (guidance must then be None)."""
        emb = self.timestep_embedder(timestep_sinusoids(timestep, self.in_channels).to(timestep.dtype))
        if self.guidance_embedder is None or skip_guidance_embedder:
            if guidance is not None:
                why = (
                    "is skipped"
                    if self.guidance_embedder is not None
                    else "is absent (guidance_embeds=False)"
                )
                raise ValueError(f"this model's guidance embedding {why}: pass guidance=None")
            return emb
        if guidance is None:
            raise ValueError("this model embeds the guidance scale: pass `guidance` (one value per sample)")
        sinusoids = timestep_sinusoids(guidance, self.in_channels).to(guidance.dtype)
        return emb + self.guidance_embedder(sinusoids)


class Flux2Modulation(nn.Module):
    """One model-level modulation: `linear(SiLU(temb))` = `sets` x (shift, scale, gate), bias-free.

    The model computes SiLU(temb) once and passes it in (`temb_act`)."""

    def __init__(self, dim: int, sets: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def forward(self, temb_act: torch.Tensor) -> torch.Tensor:
        return self.linear(temb_act)


class Flux2NormOut(nn.Module):
    """The output head's adaLN (Diffusers' `AdaLayerNormContinuous(bias=False)`): (scale, shift) from
    SiLU(temb)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim, bias=False)
        self.norm = _plain_norm(dim, eps)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        """`temb_act` = SiLU(temb), cast to x's dtype before the projection (as Diffusers does)."""
        scale, shift = self.linear(temb_act.to(x.dtype)).chunk(2, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift)


def _split_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(batch, seq, heads * head_dim) -> (batch, seq, heads, head_dim), a view."""
    return t.unflatten(-1, (-1, head_dim))


class Flux2Attention(RotaryJointAttention):
    """Double-stream joint attention over [text; image] (`RotaryJointAttention`): per-stream bias-free
    q/k/v/out and RMS QK-norms, RoPE on the joint sequence."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__(dim, num_heads, head_dim, partial(_qk_norm, head_dim, eps), bias=False)


class Flux2ParallelSelfAttention(ReusableAttention):
    """The single-stream block's attention + SwiGLU MLP, in parallel (ViT-22B style), Diffusers' names:
    `to_qkv_mlp_proj` gives [q; k; v; gate; up] and `to_out` reads [attention; SwiGLU]. An attention-level
    cache stands in for its whole output, MLP included, as diffusers' hooks do for this module."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_hidden_dim: int, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inner_dim = num_heads * head_dim
        self.mlp_hidden_dim = mlp_hidden_dim
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * self.inner_dim + 2 * mlp_hidden_dim, bias=False)
        self.norm_q = _qk_norm(head_dim, eps)
        self.norm_k = _qk_norm(head_dim, eps)
        self.to_out = nn.Linear(self.inner_dim + mlp_hidden_dim, dim, bias=False)
        self.rope = RotaryEmbedding()

    def forward(self, h: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        qkv, mlp = self.to_qkv_mlp_proj(h).split([3 * self.inner_dim, 2 * self.mlp_hidden_dim], dim=-1)
        q, k, v = (_split_heads(t, self.head_dim) for t in qkv.chunk(3, dim=-1))
        q, k = self.rope(self.norm_q(q), self.norm_k(k), *rope)
        attn = attention(q, k, v).flatten(2)
        return self.to_out(torch.cat([attn, swiglu(mlp)], dim=-1))


class Flux2TransformerBlock(nn.Module):
    """Double-stream (MMDiT) block; its shift/scale/gate vectors come from the model-level modulations."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_hidden_dim: int, eps: float) -> None:
        super().__init__()
        self.norm1 = _plain_norm(dim, eps)
        self.norm1_context = _plain_norm(dim, eps)
        self.attn = Flux2Attention(dim, num_heads, head_dim, eps)
        self.norm2 = _plain_norm(dim, eps)
        self.ff = Flux2FeedForward(dim, mlp_hidden_dim)
        self.norm2_context = _plain_norm(dim, eps)
        self.ff_context = Flux2FeedForward(dim, mlp_hidden_dim)
        self.modulate = Modulate()

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        mod_img: torch.Tensor,
        mod_txt: torch.Tensor,
        rope: RopeTables,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`mod_img`/`mod_txt`: (batch, 6 * dim), (shift, scale, gate) for attention then for the MLP."""
        # The rest of each stream's six vectors: (gate, shift_mlp, scale_mlp, gate_mlp).
        shift, scale, *x_mods = mod_img.chunk(6, dim=1)
        c_shift, c_scale, *ctx_mods = mod_txt.chunk(6, dim=1)
        attn_x, attn_ctx = self.attn(
            self.modulate(self.norm1(x), scale=scale, shift=shift),
            self.modulate(self.norm1_context(ctx), scale=c_scale, shift=c_shift),
            rope,
        )
        x = attention_mlp_residuals(x, attn_x, x_mods, self.norm2, self.ff, self.modulate)
        ctx = attention_mlp_residuals(
            ctx, attn_ctx, ctx_mods, self.norm2_context, self.ff_context, self.modulate
        )
        return fp16_clip(ctx), x


class Flux2SingleTransformerBlock(nn.Module):
    """Single-stream block on [text; image]: one modulated input feeds attention and MLP in parallel."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_hidden_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = _plain_norm(dim, eps)
        self.attn = Flux2ParallelSelfAttention(dim, num_heads, head_dim, mlp_hidden_dim, eps)
        self.modulate = Modulate()

    def forward(self, h: torch.Tensor, mod: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        """`mod`: (batch, 3 * dim), (shift, scale, gate)."""
        shift, scale, gate = mod.chunk(3, dim=1)
        out = self.attn(self.modulate(self.norm(h), scale=scale, shift=shift), rope)
        return fp16_clip(gated_residual(h, gate.unsqueeze(1), out))


# ------------------------------------------------------------------------------------------ model


def _flux2_single(
    block: nn.Module, h: torch.Tensor, mods: list[torch.Tensor], rope: RopeTables, text_len: int | None
) -> torch.Tensor:
    """FLUX.2's single-stream block in a `FluxBlockRange`: the model's last returns the image rows only."""
    out = block(h, mods[0], rope)
    return out if text_len is None else out[:, text_len:]


class Flux2Transformer2DModel(DiffusersDiT):
    """FLUX.2 DiT (dev and Klein) with Diffusers' config keys and state-dict names.

    Built from a `Flux2TransformerConfig` (`DiffusersDiT`). It holds no buffers.

    Call (see `forward`):

        rope = model.rope_tables(txt_ids, img_ids)          # once per request shape
        ctx = model.embed_context(prompt_embeds)            # once per request
        out = model(hidden_states, timestep, guidance, rope, context=ctx)

    Position ids (the rope layout), float or integer, (seq, 4) with axes (T, H, W, L), shared by the
    batch (Diffusers' pipeline builds (batch, seq, 4) with identical rows: pass `ids[0]`):

    - text token l: (0, 0, 0, l)  (`Flux2Pipeline._prepare_text_ids`);
    - noisy latent token at patch row h, column w: (0, h, w, 0)  (`_prepare_latent_ids`);
    - token (h, w) of the i-th reference image (i = 0, 1, ...): (10 + 10 i, h, w, 0)  (`_prepare_image_ids`).

    `hidden_states` is [noisy tokens; reference tokens] along the sequence (reference tokens appended
    by the caller, with their ids appended to `img_ids` in the same order); the output covers every
    image token passed and the pipeline keeps the first (noisy) ones.
    """

    diffusers_class_name: ClassVar[str] = "Flux2Transformer2DModel"
    config_class = Flux2TransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: Flux2TransformerConfig) -> None:
        super().__init__(config)
        inner, eps = config.inner_dim, config.eps
        heads, head_dim, mlp = config.num_attention_heads, config.attention_head_dim, config.mlp_hidden_dim

        self.time_guidance_embed = Flux2TimestepGuidanceEmbedding(
            config.timestep_guidance_channels, inner, config.guidance_embeds
        )
        self.double_stream_modulation_img = Flux2Modulation(inner, sets=2)
        self.double_stream_modulation_txt = Flux2Modulation(inner, sets=2)
        self.single_stream_modulation = Flux2Modulation(inner, sets=1)
        self.x_embedder = nn.Linear(config.in_channels, inner, bias=False)
        self.context_embedder = nn.Linear(config.joint_attention_dim, inner, bias=False)
        self.transformer_blocks = nn.ModuleList(
            [Flux2TransformerBlock(inner, heads, head_dim, mlp, eps) for _ in range(config.num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [
                Flux2SingleTransformerBlock(inner, heads, head_dim, mlp, eps)
                for _ in range(config.num_single_layers)
            ]
        )
        self.norm_out = Flux2NormOut(inner, eps)
        self.proj_out = nn.Linear(inner, config.patch_size**2 * config.out_channels, bias=False)

    def rope_tables(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> RopeTables:
        """Half-width (cos, sin) tables for the joint sequence [text; image] from (seq, 4) ids each.

        They depend only on the ids, i.e. on the request's shape; a caller running many steps computes
        them once and passes them to `forward(rope=...)`.
        """
        for name, ids in (("txt_ids", txt_ids), ("img_ids", img_ids)):
            if ids.ndim != 2 or ids.shape[1] != ROPE_AXES:
                raise ValueError(
                    f"{name} must be (seq, {ROPE_AXES}) (T, H, W, L), shared by the batch; "
                    f"got {tuple(ids.shape)}"
                )
        ids = torch.cat([txt_ids, img_ids], dim=0)
        return multi_axis_rope_tables(ids, self.config.axes_dims_rope, float(self.config.rope_theta))

    def embed_context(self, text_states: torch.Tensor) -> torch.Tensor:
        """Text-encoder states (batch, txt_seq, joint_attention_dim) -> the blocks' text stream
        (batch, txt_seq, inner)."""
        return self.context_embedder(text_states)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        guidance: torch.Tensor | None = None,
        rope: RopeTables | None = None,
        *,
        context: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        img_ids: torch.Tensor | None = None,
        txt_ids: torch.Tensor | None = None,
        step_cache: BatchStepCache | None = None,
        skip_guidance_embedder: bool = False,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for packed latents (and any appended reference tokens).

        Args:
            hidden_states: packed image tokens (batch, img_seq, in_channels): the noisy latents, then
                any reference-image tokens.
            timestep: (batch,) or (1,) in [0, 1] (sigma); rounded to the activation dtype and scaled by
                1000 here, as Diffusers does (its pipeline passes `t / 1000`).
            guidance: (batch,) or (1,) embedded guidance scale (not scaled by the caller) when the config
                has `guidance_embeds`, else None.
            rope: precomputed `rope_tables(txt_ids, img_ids)`; computed from the ids when None.
            context: `embed_context(encoder_hidden_states)`, given instead of `encoder_hidden_states`: the
                text states are the same at every step of a request, so a caller embeds them once.
            encoder_hidden_states: text-encoder states (batch, txt_seq, joint_attention_dim).
            img_ids, txt_ids: (img_seq, 4) and (txt_seq, 4) position ids (see the class docstring);
                needed only when `rope` is None.
            step_cache: rows of approximate-quality requests, which may reuse the blocks' residual from
                an earlier step (`models/step_cache.py`); None runs every block for every row (exact).
            skip_guidance_embedder: run a `guidance_embeds` checkpoint without its guidance embedding
                (guidance None), as Diffusers' Flux2KleinPipeline runs every FLUX.2 DiT.

        Returns:
            (batch, img_seq, patch_size**2 * out_channels), one prediction per image token passed.
        """
        batch = hidden_states.shape[0]
        check_per_sample(batch, timestep=timestep, guidance=guidance)
        check_one_text_input(encoder_hidden_states, context, "text states")
        if rope is None:
            if img_ids is None or txt_ids is None:
                raise ValueError("pass rope (rope_tables(txt_ids, img_ids)) or both img_ids and txt_ids")
            rope = self.rope_tables(txt_ids, img_ids)

        # Rounded to the activation dtype before scaling, as Diffusers does (it matters in bf16).
        dtype = hidden_states.dtype
        timestep = timestep.to(dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        temb = self.time_guidance_embed(timestep, guidance, skip_guidance_embedder)
        temb_act = F.silu(temb)  # every modulation projects SiLU(temb): computed once
        mods = (
            self.double_stream_modulation_img(temb_act),
            self.double_stream_modulation_txt(temb_act),
            self.single_stream_modulation(temb_act),
        )

        x = self.x_embedder(hidden_states)
        ctx = self.embed_context(encoder_hidden_states) if context is None else context
        x = run_with_step_cache(
            step_cache,
            x,
            lambda: self._cache_signal(x, mods),
            lambda rows: self._run_blocks(
                take_rows(x, rows), take_rows(ctx, rows), tuple(take_rows(m, rows) for m in mods), rope
            ),
            blocks=lambda: self._block_range(x, ctx, mods, rope),
        )
        return self.proj_out(self.norm_out(x, temb_act))

    def _block_range(
        self, x: torch.Tensor, ctx: torch.Tensor, mods: tuple[torch.Tensor, ...], rope: RopeTables
    ) -> FluxBlockRange:
        """The double- then single-stream blocks as one sequence for DBCache (every block of a kind shares
        its modulation; the last returns the image rows, as `_run_blocks`)."""
        mod_img, mod_txt, mod_single = mods
        per_block = [[mod_img, mod_txt]] * len(self.transformer_blocks)
        per_block += [[mod_single]] * len(self.single_transformer_blocks)
        return FluxBlockRange(
            self.transformer_blocks, self.single_transformer_blocks, x, ctx, per_block, rope,
            single=_flux2_single,
        )  # fmt: skip

    def _run_blocks(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        mods: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rope: RopeTables,
    ) -> torch.Tensor:
        """Every double- and single-stream block; returns the image tokens the output head reads.

        `mods`: the double-stream image and text modulations and the single-stream one."""
        mod_img, mod_txt, mod_single = mods
        for block in self.transformer_blocks:
            ctx, x = block(x, ctx, mod_img, mod_txt, rope)
        if not self.single_transformer_blocks:
            return x
        txt_len = ctx.shape[1]
        h = torch.cat([ctx, x], dim=1)
        for block in self.single_transformer_blocks:
            h = block(h, mod_single, rope)
        return h[:, txt_len:]

    def _cache_signal(self, x: torch.Tensor, mods: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The first block's timestep-modulated image input: what the step cache watches change."""
        if len(self.transformer_blocks):
            block = self.transformer_blocks[0]
            shift, scale = mods[0].chunk(6, dim=1)[:2]
            return block.modulate(block.norm1(x), scale=scale, shift=shift)
        block = self.single_transformer_blocks[0]
        shift, scale = mods[2].chunk(3, dim=1)[:2]
        return block.modulate(block.norm(x), scale=scale, shift=shift)
