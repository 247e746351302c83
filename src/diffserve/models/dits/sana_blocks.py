"""What SANA's image DiT (`sana.py`) and SANA-Video's (`sana_video.py`) share, loading Diffusers' weights
unchanged: the adaLN-single timestep (and guidance) embedding, the masked softmax cross-attention to the
Gemma-2 text, the block's modulated residual skeleton, and the model's text and timestep conditioning,
block loop and output head.

Each DiT adds its own: the patch embedding, the ReLU linear self-attention's forward (SANA-Video's rotates
its numerator by RoPE), the Mix-FFN's layout (an image map, or every frame of a video then a temporal
conv) and the unpatchify. The block and the model build their layers in Diffusers' order, so a model
randomly initialised under a seed draws the same numbers as before the split.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.layers.attention import attention
from diffserve.layers.attention_weights import AttentionWeights, QKNormFactory
from diffserve.layers.embeddings import GeluTanhTextProjection, TimestepEmbedding, timestep_sinusoids
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.residual import gated_residual
from diffserve.models.cache_methods.blocks import SequentialBlocks
from diffserve.models.dits.base import DiffusersDiT
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows

#: Sinusoid width of the timestep and guidance embeddings (Diffusers' `Timesteps(256, ...)`).
TIMESTEP_CHANNELS = 256
#: The caption norm's and the QK-norms' epsilon (Diffusers' RMSNorm / Attention default).
RMS_EPS = 1e-5
#: Linear attention's denominator guard, as Diffusers'.
LINEAR_ATTENTION_EPS = 1e-15
#: Diffusers turns the 0/1 text mask into an additive bias of -10000 (not -inf); kept for parity, so a
#: fully masked row attends uniformly instead of producing NaN.
MASK_BIAS = -10000.0
#: The only QK-norm Diffusers builds for these DiTs (None or RMSNorm over all heads).
SUPPORTED_QK_NORMS = (None, "rms_norm_across_heads")


class SanaBlockConfig(Protocol):
    """The config keys a SANA block and the shared model layers read (both DiTs' configs have them)."""

    inner_dim: int
    num_attention_heads: int
    attention_head_dim: int
    num_layers: int
    num_cross_attention_heads: int | None
    cross_attention_head_dim: int | None
    cross_attention_dim: int | None
    caption_channels: int
    mlp_ratio: float
    attention_bias: bool
    norm_elementwise_affine: bool
    norm_eps: float
    guidance_embeds: bool
    qk_norm: str | None


def check_text_cross_attention(config: SanaBlockConfig, model_name: str) -> None:
    """ValueError unless the config has the text cross-attention the blocks need, as wide as the blocks
    (the caption projection outputs the inner width); `model_name` leads the message."""
    if config.cross_attention_dim is None or not config.num_cross_attention_heads:
        raise ValueError(
            f"{model_name}: cross_attention_dim / num_cross_attention_heads None (no text "
            "cross-attention) is not supported (Diffusers' block cannot run without it either)"
        )
    if config.cross_attention_dim != config.inner_dim:
        raise ValueError(
            f"{model_name}: cross_attention_dim ({config.cross_attention_dim}) must equal "
            f"num_attention_heads * attention_head_dim ({config.inner_dim}): the caption projection "
            "outputs the inner width"
        )


# ------------------------------------------------------------------------------------- embeddings


class _TimestepOnlyEmbedding(nn.Module):
    """Holds `timestep_embedder` under the name Diffusers gives it (`time_embed.emb.timestep_embedder`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, dim)


class AdaLayerNormSingle(nn.Module):
    """adaLN-single (PixArt): emb = MLP(sinusoids(t)); the blocks' six modulation vectors = Linear(SiLU(emb)).

    `forward` returns (modulations (batch, 6 * dim), emb (batch, dim)); the output head reads `emb`.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.emb = _TimestepOnlyEmbedding(dim)
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(
        self, timestep: torch.Tensor, guidance: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if guidance is not None:
            raise ValueError(
                "this SANA model has no guidance embedding (guidance_embeds=False): pass guidance=None"
            )
        emb = self.emb.timestep_embedder(timestep_sinusoids(timestep, TIMESTEP_CHANNELS).to(dtype))
        return self.linear(F.silu(emb)), emb


class TimestepGuidanceEmbedding(nn.Module):
    """SANA-Sprint's adaLN-single: emb = MLP(sinusoids(t)) + MLP(sinusoids(guidance)), then as `AdaLayerNormSingle`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, dim)
        self.guidance_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, dim)
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(
        self, timestep: torch.Tensor, guidance: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if guidance is None:
            raise ValueError(
                "this SANA model embeds the guidance scale (guidance_embeds=True): pass `guidance`, "
                "already multiplied by config.guidance_embeds_scale"
            )
        emb = self.timestep_embedder(timestep_sinusoids(timestep, TIMESTEP_CHANNELS).to(dtype))
        emb = emb + self.guidance_embedder(timestep_sinusoids(guidance, TIMESTEP_CHANNELS).to(dtype))
        return self.linear(F.silu(emb)), emb


# ------------------------------------------------------------------------------------- attention


def _across_heads_norm(width: int) -> RMSNorm:
    """`qk_norm="rms_norm_across_heads"`: Diffusers' RMSNorm over all heads at once, eps 1e-5."""
    return RMSNorm(width, eps=RMS_EPS)


def across_heads_qk_norm(qk_norm: bool, num_heads: int, head_dim: int) -> QKNormFactory | None:
    """The QK-norm factory of an attention with `num_heads` x `head_dim` q/k (None without QK-norm)."""
    return partial(_across_heads_norm, num_heads * head_dim) if qk_norm else None


class LinearAttentionWeights(AttentionWeights):
    """The weights of a ReLU linear self-attention (q, k, v from the tokens, optional QK-norms across all
    heads); each DiT adds its forward."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, bias: bool, qk_norm: bool) -> None:
        norm = across_heads_qk_norm(qk_norm, num_heads, head_dim)
        super().__init__(dim, num_heads, head_dim, norm, bias=bias)
        self.num_heads = num_heads


class SanaCrossAttention(AttentionWeights):
    """Softmax attention from the image tokens to the text, with the text padding masked by a bias."""

    def __init__(
        self, dim: int, context_dim: int, num_heads: int, head_dim: int, out_bias: bool, qk_norm: bool
    ) -> None:
        norm = across_heads_qk_norm(qk_norm, num_heads, head_dim)
        super().__init__(dim, num_heads, head_dim, norm, kv_dim=context_dim, out_bias=out_bias)
        self.num_heads = num_heads

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask_bias: torch.Tensor | None) -> torch.Tensor:
        """x (batch, tokens, dim), ctx (batch, L, context_dim), mask_bias (batch, 1, 1, L) or None."""
        q, k, v = self.to_q(x), self.to_k(ctx), self.to_v(ctx)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)) for t in (q, k, v))
        out = attention(q, k, v, attn_mask=mask_bias).flatten(2).to(q.dtype)
        return self.to_out[0](out)


# ---------------------------------------------------------------------------------------- blocks

#: (batch, tokens, dim) -> (batch, tokens, dim): a block's self-attention or Mix-FFN on its tokens.
TokenMap = Callable[[torch.Tensor], torch.Tensor]


class SanaBlockBase(nn.Module):
    """A SANA block's layers and modulated residuals: x += gate_msa * self-attention(adaLN(x)); x +=
    cross-attention(x, text); x += gate_mlp * Mix-FFN(adaLN(x)).

    Built in Diffusers' order (norm1, attn1, norm2, attn2, ff) from `self_attention` and `feed_forward`
    (dim, mlp_ratio); the subclass adds its `scale_shift_table` (6, dim), the per-block offsets of the
    six shared modulation vectors, and a forward that calls `modulated` with how its attention and
    Mix-FFN read the token layout.
    """

    scale_shift_table: nn.Parameter

    def __init__(
        self,
        config: SanaBlockConfig,
        self_attention: type[LinearAttentionWeights],
        feed_forward: Callable[[int, float], nn.Module],
    ) -> None:
        super().__init__()
        dim = config.inner_dim
        qk_norm = config.qk_norm is not None
        self.dim = dim
        self.norm1 = LayerNorm(dim, eps=config.norm_eps, elementwise_affine=False)
        self.attn1 = self_attention(
            dim, config.num_attention_heads, config.attention_head_dim, config.attention_bias, qk_norm
        )
        self.norm2 = LayerNorm(dim, eps=config.norm_eps, elementwise_affine=config.norm_elementwise_affine)
        self.attn2 = SanaCrossAttention(
            dim,
            int(config.cross_attention_dim),
            int(config.num_cross_attention_heads),
            int(config.cross_attention_head_dim),
            out_bias=True,
            qk_norm=qk_norm,
        )
        self.ff = feed_forward(dim, config.mlp_ratio)

    def modulated(
        self,
        self_attention: TokenMap,
        feed_forward: TokenMap,
        x: torch.Tensor,
        ctx: torch.Tensor,
        mask_bias: torch.Tensor | None,
        modulation: torch.Tensor,
    ) -> torch.Tensor:
        """x (batch, tokens, dim) through the block, `self_attention` and `feed_forward` running this
        block's attn1 and ff on the tokens; modulation (batch, 6 * dim), the shared adaLN-single
        projection."""
        mods = self.scale_shift_table[None] + modulation.unflatten(1, (6, self.dim))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.unsqueeze(2).unbind(1)

        h = (self.norm1(x) * (1 + scale_msa) + shift_msa).to(x.dtype)
        x = gated_residual(x, gate_msa, self_attention(h))
        x = x + self.attn2(x, ctx, mask_bias)

        h = self.norm2(x) * (1 + scale_mlp) + shift_mlp
        return gated_residual(x, gate_mlp, feed_forward(h))

    def modulated_input(self, x: torch.Tensor, modulation: torch.Tensor) -> torch.Tensor:
        """The self-attention's timestep-modulated input: what TeaCache-like methods watch change."""
        mods = self.scale_shift_table[None] + modulation.unflatten(1, (6, self.dim))
        shift, scale = mods[:, 0:1], mods[:, 1:2]
        return (self.norm1(x) * (1 + scale) + shift).to(x.dtype)


#: (ctx, mask_bias, modulation): what every block reads besides the tokens and their layout.
BlockInputs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


def block_input_rows(inputs: BlockInputs, rows: torch.Tensor | None) -> BlockInputs:
    """`inputs` for batch rows `rows` (None: all); no text mask stays none."""
    ctx, mask_bias, modulation = inputs
    mask_rows = None if mask_bias is None else take_rows(mask_bias, rows)
    return take_rows(ctx, rows), mask_rows, take_rows(modulation, rows)


# ----------------------------------------------------------------------------------------- model


class SanaDiTBase(DiffusersDiT):
    """The model layers both SANA DiTs share, and their forward between the patch embedding and the
    unpatchify (`_predict_tokens`).

    A subclass builds its patch embedding, then `_build_shared_layers` (time_embed, caption_projection,
    caption_norm, transformer_blocks), then its `scale_shift_table` (2, inner), `norm_out` and `proj_out`:
    Diffusers' order. Its blocks are called `block(x, ctx, mask_bias, modulation, *layout)`, `layout`
    being how the blocks read the token sequence (the image's height and width; the video's RoPE tables
    and grid).
    """

    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    time_embed: AdaLayerNormSingle | TimestepGuidanceEmbedding
    scale_shift_table: nn.Parameter

    def _build_shared_layers(
        self, config: SanaBlockConfig, block: Callable[[SanaBlockConfig], SanaBlockBase]
    ) -> None:
        """The timestep embedding, the caption embedder and `config.num_layers` blocks `block(config)`."""
        inner = config.inner_dim
        self.time_embed = (
            TimestepGuidanceEmbedding(inner) if config.guidance_embeds else AdaLayerNormSingle(inner)
        )
        self.caption_projection = GeluTanhTextProjection(config.caption_channels, inner)
        self.caption_norm = RMSNorm(inner, eps=RMS_EPS)
        self.transformer_blocks = nn.ModuleList([block(config) for _ in range(config.num_layers)])

    def embed_context(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """Gemma-2 states (batch, L, caption_channels) -> the cross-attention context (batch, L, inner).

        The same at every denoising step of a request: a caller running many steps embeds it once and
        passes it to `forward(context=...)`.
        """
        return self.caption_norm(self.caption_projection(encoder_hidden_states))

    @staticmethod
    def mask_bias(encoder_attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """(batch, L) 0/1 mask -> (batch, 1, 1, L) additive bias in `dtype` (0 keep, -10000 drop), as Diffusers."""
        if encoder_attention_mask is None:
            return None
        if encoder_attention_mask.ndim != 2:
            raise ValueError(
                f"encoder_attention_mask must be (batch, text_len), got {tuple(encoder_attention_mask.shape)}"
            )
        bias = (1 - encoder_attention_mask.to(dtype)) * MASK_BIAS
        return bias[:, None, None, :]

    def _predict_tokens(
        self,
        x: torch.Tensor,
        layout: tuple[object, ...],
        step_cache: BatchStepCache | None,
        timestep: torch.Tensor,
        guidance: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        context: torch.Tensor | None,
    ) -> torch.Tensor:
        """Patch tokens x (batch, tokens, inner) -> the output head's (batch, tokens, patch volume x
        out_channels): the text and timestep conditioning, the blocks on `layout` (through `step_cache`'s
        cache methods when given), the modulated output norm and `proj_out`. The rest are `forward`'s."""
        batch = x.shape[0]
        guidance = None if guidance is None else guidance.expand(batch)
        modulation, emb = self.time_embed(timestep.expand(batch), guidance, x.dtype)
        ctx = self.embed_context(encoder_hidden_states) if context is None else context
        inputs = (ctx, self.mask_bias(encoder_attention_mask, x.dtype), modulation)

        x = run_with_step_cache(
            step_cache,
            x,
            lambda: self.transformer_blocks[0].modulated_input(x, modulation),
            lambda rows: self._run_blocks(take_rows(x, rows), block_input_rows(inputs, rows), layout),
            blocks=lambda: self._block_range(x, inputs, layout),
        )

        shift, scale = (self.scale_shift_table[None] + emb[:, None]).unbind(1)
        x = self.norm_out(x) * (1 + scale[:, None]) + shift[:, None]
        return self.proj_out(x)

    def _run_blocks(self, x: torch.Tensor, inputs: BlockInputs, layout: tuple[object, ...]) -> torch.Tensor:
        """Every block, in order: the image tokens the output head reads."""
        for block in self.transformer_blocks:
            x = block(x, *inputs, *layout)
        return x

    def _block_range(
        self, x: torch.Tensor, inputs: BlockInputs, layout: tuple[object, ...]
    ) -> SequentialBlocks:
        """The blocks as a `BlockRange` for DBCache: one image stream (the caption is cross-attention
        context, which no block changes)."""

        def call(i: int, x: torch.Tensor, text: torch.Tensor | None, inputs: BlockInputs) -> tuple:
            return self.transformer_blocks[i](x, *inputs, *layout), None

        return SequentialBlocks(
            len(self.transformer_blocks), x, None, partial(block_input_rows, inputs), call
        )
