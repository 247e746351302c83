"""Wan 2.1 video transformer (Alibaba Wan team), native, loading Diffusers `WanTransformer3DModel` weights unchanged.

Architecture (cross-attention DiT over spatio-temporal patches):

    x    = patch_embedding(latents)   Conv3d, stride = patch (1, 2, 2)       (batch, F'*H'*W', inner)
    temb = MLP(sinusoids(t))                                                 (batch, inner)   one per sample
    mod  = time_proj(SiLU(temb)) -> 6 vectors per sample, each block adds its own `scale_shift_table`
    ctx  = text_embedder(UMT5 states)                                        (batch, txt_seq, inner)
    img  = image_embedder(CLIP image states)   I2V / FLF2V only              (batch, 257 or 514, inner)
    num_layers x block:
        x += gate * self_attn(modulate(LN(x)), 3-axis RoPE)      qk RMSNorm across all heads
        x += cross_attn(LN_affine(x), ctx [, img])               text and image attended separately, summed
        x += gate * FFN_gelu_tanh(modulate(LN(x)))
    out  = unpatchify(proj_out(modulate(LN(x), temb + scale_shift_table)))  (batch, out_channels, F, H, W)

RoPE: the head dimension is split into (frame, row, column) slices; the row and column slices get
`2 * (head_dim // 6)` channels each and the frame slice the rest. Token (f, h, w) rotates channel pair
`i` of an axis slice by `pos_axis * 10000 ** (-2i / axis_dim)`, pairs interleaved. The tables depend only
on the latent grid, so they are cached per (grid, device).

The modulation has one row per sample (or, for Wan 2.2 TI2V-style inputs, one row per token), so one
forward serves requests at different timesteps (the engine's step-level batching and CFG branches).
Norms, modulation and gated residual adds run in fp32 as in Diffusers, and the result is rounded back
to the activation dtype.

Step cache (approximate quality tiers, `models/step_cache.py`): the cached span is the blocks, from the
patch embedding's tokens to the hidden state before `norm_out`; the watched signal is the first block's
modulated self-attention input. Text and (I2V) image tokens, the modulation and any per-token timesteps
are sliced per batch row; the RoPE tables are shared.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): the flattened video tokens
are split with their RoPE table rows (and per-token timesteps), the self-attention runs over every
rank's tokens and the cross-attention to the replicated text/image tokens stays local
(`_run_blocks_split`). With one sequence-parallel rank nothing changes.

Tensor parallelism (`shard_for_tensor_parallel`, before the weights are read): each TP rank holds 1/T of
the heads and FFN features of every block. Self- and cross-attention q/k/v (and I2V's image k/v) are
column-parallel by heads, their output projections row-parallel, the FFN column then row: one
all-reduce per attention and per FFN. Wan's QK-norm normalises across *all* heads (RMSNorm over the full
inner width), so on a head shard it becomes `ParallelRMSNorm`: the weight is split with the heads and the
sum of squares is all-reduced (one small all-reduce per norm). The patch embedding, time/text/image
embedders, block modulation tables, LayerNorms and the output head are replicated. TP composes with the
sequence split: Ulysses and Ring then move this rank's heads only.

Differences from Diffusers that do not change the numbers for the inputs its pipelines pass: the image
and text context are split at the known image length, not at "all but the last 512 tokens" (so any text
length works), the split is done once per forward instead of once per block, RoPE tables are
half width and built for the grid only (not for `rope_max_seq_len` positions), and latents whose frame
or spatial size is not a multiple of the patch size are rejected instead of being cropped. `qk_norm`
other than "rms_norm_across_heads" is rejected (Diffusers ignores the key and always uses that norm).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.attention import attention
from diffserve.layers.attention_weights import AttentionWeights
from diffserve.layers.embeddings import GeluTanhTextProjection, TimestepEmbedding, timestep_sinusoids
from diffserve.layers.feedforward import FeedForward
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.patches import video_patch_grid
from diffserve.layers.rotary import RopeTables, RotaryEmbedding, multi_axis_rope_tables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
    shard_linear,
    shard_rms_norm,
)
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.dits.base import DiffusersDiT, DiTConfig, check_tp_divides, shard_blocks
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows
from diffserve.platforms import Platform

ROPE_THETA = 10000.0
#: The image embedder's LayerNorms use torch's default eps, not the model's `eps`.
IMAGE_NORM_EPS = 1e-5
#: RoPE tables kept per (grid, device); a server sees a handful of video sizes.
ROPE_CACHE_SIZE = 16


@dataclass(frozen=True)
class WanTransformerConfig(DiTConfig):
    """The Wan 2.1 DiT's Diffusers config (`transformer/config.json`), one field per key.

    Wan2.1-T2V-14B: 40 heads x 128, 40 layers, ffn 13824 (the defaults); Wan2.1-T2V-1.3B: 12 heads,
    30 layers, ffn 8960; I2V adds image_dim 1280, added_kv_proj_dim 5120 and in_channels 36; FLF2V
    also sets pos_embed_seq_len 514. `out_channels` None means `in_channels` and is resolved when the
    config is built; sequences become tuples.
    """

    patch_size: tuple[int, ...] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self) -> None:
        patch_size = tuple(int(p) for p in self.patch_size)
        if len(patch_size) != 3:
            raise ValueError(f"patch_size must be (frames, height, width), got {patch_size}")
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(
                f"qk_norm {self.qk_norm!r} is not supported; Wan checkpoints use 'rms_norm_across_heads'"
            )
        if self.attention_head_dim % 2:
            raise ValueError(f"attention_head_dim must be even for RoPE, got {self.attention_head_dim}")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError(
                "image_dim and added_kv_proj_dim must be set together (I2V) or both be None (T2V), "
                f"got image_dim={self.image_dim}, added_kv_proj_dim={self.added_kv_proj_dim}"
            )
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.inner_dim:
            raise ValueError(
                f"added_kv_proj_dim ({self.added_kv_proj_dim}) must equal the model width "
                f"num_attention_heads * attention_head_dim ({self.inner_dim}): it projects embedded image "
                "tokens"
            )
        # pos_embed_seq_len without image_dim is unused, as in Diffusers (the image embedder holds the table).
        self._normalise(patch_size=patch_size, out_channels=self.out_channels or self.in_channels)


def wan_rope_axes_dims(head_dim: int) -> tuple[int, int, int]:
    """(frame, row, column) channel split of a head: rows and columns get 2*(head_dim//6) each, frames the rest."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def wan_grid_rope_tables(
    frames: int, height: int, width: int, axes_dims: Sequence[int], max_seq_len: int, device: torch.device
) -> RopeTables:
    """Half-width (cos, sin) float32 tables (frames*height*width, head_dim // 2) for a post-patch grid,
    tokens in (frame, row, column) row-major order (the flattened patch embedding's); ValueError when an
    axis is longer than `max_seq_len` (the config's `rope_max_seq_len`)."""
    if max(frames, height, width) > max_seq_len:
        raise ValueError(
            f"latent grid {(frames, height, width)} (after patching) exceeds rope_max_seq_len "
            f"({max_seq_len}) along one axis"
        )
    axes = [torch.arange(n, device=device) for n in (frames, height, width)]
    ids = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    return multi_axis_rope_tables(ids, axes_dims, ROPE_THETA)


class FP32LayerNorm(LayerNorm):
    """LayerNorm computed in fp32 (input and affine parameters upcast), result in the input dtype.

    Wan keeps its norms in fp32 even in a bf16 model; computing in fp32 here gives the same numbers
    whatever dtype the loader stored the weights in. Always the native form: a vendor LayerNorm kernel
    registered on the base class would not promise the fp32 upcast.
    """

    def dispatch_forward(self, platform: Platform) -> Callable[..., Any]:
        return self.forward_native

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), (self.dim,), weight, bias, self.eps).to(x.dtype)


class WanImageEmbedding(nn.Module):
    """CLIP image states -> model width: LN, GELU MLP, LN. FLF2V adds a learned position table over both images."""

    def __init__(self, in_features: int, out_features: int, pos_embed_seq_len: int | None = None) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(in_features, eps=IMAGE_NORM_EPS)
        self.ff = FeedForward(in_features, in_features, out_features, approximate="none")
        self.norm2 = FP32LayerNorm(out_features, eps=IMAGE_NORM_EPS)
        self.pos_embed_seq_len = pos_embed_seq_len
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, pos_embed_seq_len, in_features))
            if pos_embed_seq_len is not None
            else None
        )

    def forward(self, image_states: torch.Tensor, batch: int) -> torch.Tensor:
        if self.pos_embed is not None:
            # FLF2V: the first- and last-frame CLIP states form one sequence per sample. Diffusers'
            # pipeline passes them as (2 * batch, 257, dim); (batch, 514, dim) is accepted as well.
            image_states = image_states.reshape(batch, -1, image_states.shape[-1])
            if image_states.shape[1] != self.pos_embed_seq_len:
                raise ValueError(
                    f"encoder_hidden_states_image must hold {self.pos_embed_seq_len} tokens per sample "
                    f"(first and last frame), got {image_states.shape[1]}"
                )
            image_states = image_states + self.pos_embed
        return self.norm2(self.ff(self.norm1(image_states)))


class WanConditionEmbedding(nn.Module):
    """Timestep, text and (I2V) image conditioning; Diffusers' `WanTimeTextImageEmbedding` names."""

    def __init__(
        self,
        dim: int,
        freq_dim: int,
        text_dim: int,
        image_dim: int | None,
        pos_embed_seq_len: int | None,
    ) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = TimestepEmbedding(freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = GeluTanhTextProjection(text_dim, dim)
        self.image_embedder = (
            WanImageEmbedding(image_dim, dim, pos_embed_seq_len) if image_dim is not None else None
        )

    def time(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, tokens) timesteps (tokens is 1 or seq) -> temb (batch, tokens, dim), block modulation (batch, tokens, 6, dim).

        The sinusoids go through the MLP in its weights' dtype (fp32 in Diffusers' bf16 checkpoints),
        and temb is rounded to the activation dtype before the block projection, as in Diffusers.
        """
        sinusoids = timestep_sinusoids(timestep.flatten(), self.freq_dim).unflatten(0, timestep.shape)
        temb = self.time_embedder(sinusoids.to(self.time_embedder.linear_1.weight.dtype)).to(dtype)
        return temb, self.time_proj(F.silu(temb)).unflatten(-1, (6, -1))


class _WanAttention(AttentionWeights):
    """What Wan's self- and cross-attention share (Diffusers' `WanAttention`): q/k/v and output
    projections, and RMSNorms of q and k over their full width (all heads together)."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__(dim, num_heads, dim // num_heads, partial(RMSNorm, dim, eps=eps, round_once=True))
        self.num_heads = num_heads

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads: q and every k/v (the cross-attention's image k/v too) column-parallel with
        their across-heads norms, `to_out` row-parallel (a cross-attention sums its text and image
        outputs locally before it)."""
        for name in ("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"):
            if getattr(self, name, None) is not None:
                shard_linear(self, name, ColumnParallelLinear, tp)
        shard_linear(self, "to_out.0", RowParallelLinear, tp)
        for name in ("norm_q", "norm_k", "norm_added_k"):
            if getattr(self, name, None) is not None:
                shard_rms_norm(self, name, tp)
        self.num_heads //= tp.tp_size


class WanSelfAttention(_WanAttention):
    """Self-attention with RMSNorm over the full q/k width (all heads together) and 3-axis RoPE."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__(dim, num_heads, eps)
        self.rope = RotaryEmbedding()

    def forward(
        self, x: torch.Tensor, rope: RopeTables, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = self.norm_q(self.to_q(x)).unflatten(-1, (self.num_heads, -1))
        k = self.norm_k(self.to_k(x)).unflatten(-1, (self.num_heads, -1))
        v = self.to_v(x).unflatten(-1, (self.num_heads, -1))
        q, k = self.rope(q, k, *rope)
        if attn_mask is not None:  # a (1, 1, seq, seq) mask (block-causal frames): never sequence-split
            return self.to_out[0](attention(q, k, v, attn_mask).flatten(2))
        # Over every rank's video tokens when the sequence is split (`_run_blocks_split`).
        return self.to_out[0](sequence_attention(q, k, v).flatten(2))


class WanCrossAttention(_WanAttention):
    """Queries from the video tokens; keys/values from the text, and for I2V separately from the image.

    The two attention outputs are summed before the output projection (two softmaxes, not one over
    the concatenated context). The image branch has its own k/v projections and k-norm; q is shared.
    The keys are replicated on every rank, so under a sequence split this rank's shard of queries
    attends to them with plain `attention()`: no communication.
    """

    def __init__(self, dim: int, num_heads: int, eps: float, added_kv_proj_dim: int | None) -> None:
        super().__init__(dim, num_heads, eps)
        self.is_cross_attention = True
        if added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            self.norm_added_k = RMSNorm(dim, eps=eps, round_once=True)
        else:
            self.add_k_proj = self.add_v_proj = self.norm_added_k = None

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, img: torch.Tensor | None) -> torch.Tensor:
        heads = self.num_heads
        q = self.norm_q(self.to_q(x)).unflatten(-1, (heads, -1))
        k = self.norm_k(self.to_k(ctx)).unflatten(-1, (heads, -1))
        v = self.to_v(ctx).unflatten(-1, (heads, -1))
        if img is not None:
            k_img = self.norm_added_k(self.add_k_proj(img)).unflatten(-1, (heads, -1))
            v_img = self.add_v_proj(img).unflatten(-1, (heads, -1))
            out_img = attention(q, k_img, v_img).flatten(2)
            out = attention(q, k, v).flatten(2) + out_img
        else:
            out = attention(q, k, v).flatten(2)
        return self.to_out[0](out)


class WanTransformerBlock(nn.Module):
    """Self-attention and FFN modulated by six per-sample vectors (time projection + `scale_shift_table`);
    the cross-attention in between is not modulated."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_heads: int,
        cross_attn_norm: bool,
        eps: float,
        added_kv_proj_dim: int | None,
    ) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.attn1 = WanSelfAttention(dim, num_heads, eps)
        self.attn2 = WanCrossAttention(dim, num_heads, eps, added_kv_proj_dim)
        self.norm2 = FP32LayerNorm(dim, eps=eps) if cross_attn_norm else None
        self.ffn = FeedForward(dim, ffn_dim)
        self.norm3 = FP32LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6, dim))

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads of both attentions and its slice of the FFN features (see the model's)."""
        for module in (self.attn1, self.attn2, self.ffn):
            module.shard_for_tensor_parallel(tp)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        img: torch.Tensor | None,
        time_mod: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # time_mod: (batch, 1 or seq, 6, dim); each vector broadcasts over (batch, seq, dim).
        mod = self.scale_shift_table.float().unsqueeze(0) + time_mod.float()
        shift_msa, scale_msa, gate_msa, shift_ff, scale_ff, gate_ff = mod.unbind(2)
        dtype = x.dtype

        h = self._modulate_attention_input(x, shift_msa, scale_msa)
        x = (self.attn1(h, rope, attn_mask) * gate_msa).add_(x.float()).to(dtype)

        h = self.norm2(x.float()).to(dtype) if self.norm2 is not None else x
        x = x + self.attn2(h, ctx, img)

        h = (self.norm3(x.float()) * (1 + scale_ff)).add_(shift_ff).to(dtype)
        return (self.ffn(h).float() * gate_ff).add_(x.float()).to(dtype)

    def modulated_input(self, x: torch.Tensor, time_mod: torch.Tensor) -> torch.Tensor:
        """The self-attention input `modulate(LN(x))`: the cheap, timestep-aware value the step cache
        watches (one LayerNorm and a scale/shift; the block's own modulation vectors)."""
        shift_msa, scale_msa = (
            self.scale_shift_table[:, :2].float().unsqueeze(0) + time_mod[:, :, :2].float()
        ).unbind(2)
        return self._modulate_attention_input(x, shift_msa, scale_msa)

    def _modulate_attention_input(
        self, x: torch.Tensor, shift_msa: torch.Tensor, scale_msa: torch.Tensor
    ) -> torch.Tensor:
        return (self.norm1(x.float()) * (1 + scale_msa)).add_(shift_msa).to(x.dtype)


class EmbeddedContext(NamedTuple):
    """The cross-attention context of a batch: [image tokens; text tokens] embedded, (batch, seq, dim)."""

    states: torch.Tensor
    image_len: int  # leading image tokens (I2V's CLIP states); 0 for text-to-video


class WanTransformer3DModel(DiffusersDiT):
    """Wan 2.1 DiT (T2V, I2V, FLF2V) with Diffusers' config keys and state-dict names.

    Built from a `WanTransformerConfig` (`DiffusersDiT`). It holds no buffers; RoPE tables are built on first
    use per latent grid and cached.
    """

    diffusers_class_name: ClassVar[str] = "WanTransformer3DModel"
    config_class = WanTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("blocks",)

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__(config)
        inner, patch_size, eps = config.inner_dim, config.patch_size, config.eps
        self.rope_axes_dims = wan_rope_axes_dims(config.attention_head_dim)
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache(ROPE_CACHE_SIZE)

        self.patch_embedding = nn.Conv3d(config.in_channels, inner, kernel_size=patch_size, stride=patch_size)
        self.condition_embedder = WanConditionEmbedding(
            inner, config.freq_dim, config.text_dim, config.image_dim, config.pos_embed_seq_len
        )
        self.blocks = nn.ModuleList(
            [
                WanTransformerBlock(
                    inner,
                    config.ffn_dim,
                    config.num_attention_heads,
                    config.cross_attn_norm,
                    eps,
                    config.added_kv_proj_dim,
                )
                for _ in range(config.num_layers)
            ]
        )
        self.norm_out = FP32LayerNorm(inner, eps=eps, elementwise_affine=False)
        self.proj_out = nn.Linear(inner, config.out_channels * math.prod(patch_size))
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, inner))

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """Make this model rank `tp.tp_rank`'s shard of a `tp.tp_size`-way tensor-parallel DiT; call it on
        the meta-built model, before the weights are loaded (the loader then reads only the shard).

        Every block's attentions hold heads / T whole heads (q/k/v column-parallel, their across-heads
        RMSNorms as `ParallelRMSNorm`, outputs row-parallel) and ffn_dim / T FFN features; everything else
        is replicated (module docstring). The heads and the FFN width must divide `tp.tp_size`
        (ValueError naming them)."""
        heads, ffn_dim = self.config.num_attention_heads, self.config.ffn_dim
        check_tp_divides(tp, heads, f"the Wan DiT's {heads} attention heads do not divide")
        check_tp_divides(tp, ffn_dim, f"the Wan DiT's FFN width ffn_dim={ffn_dim} does not divide")
        shard_blocks(self, tp, self.blocks)

    def rope_tables(self, frames: int, height: int, width: int, device: torch.device) -> RopeTables:
        """Half-width (cos, sin) float32 tables (frames*height*width, head_dim // 2) for a post-patch grid.

        Tokens are in (frame, row, column) row-major order, the order of the flattened patch embedding
        (`wan_grid_rope_tables`). Cached per grid and device: every step of a request, and every same-size
        request, reuses them.
        """
        return self._rope_cache.get_or_build(
            (frames, height, width),
            device,
            lambda: wan_grid_rope_tables(
                frames, height, width, self.rope_axes_dims, self.config.rope_max_seq_len, device
            ),
        )

    def embed_context(
        self, encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None = None
    ) -> EmbeddedContext:
        """What the blocks cross-attend to: [image; text] states through their embedders (see `forward`)."""
        embedder = self.condition_embedder
        if embedder.image_embedder is None and encoder_hidden_states_image is not None:
            raise ValueError(
                "this is a text-to-video model (image_dim=None): pass encoder_hidden_states_image=None"
            )
        if embedder.image_embedder is not None and encoder_hidden_states_image is None:
            raise ValueError(
                "this image-to-video model needs encoder_hidden_states_image (CLIP image states)"
            )
        text = embedder.text_embedder(encoder_hidden_states)
        if encoder_hidden_states_image is None:
            return EmbeddedContext(text, 0)
        img = embedder.image_embedder(encoder_hidden_states_image, encoder_hidden_states.shape[0])
        # Diffusers concatenates [image; text] once and every block projects strided slices of it;
        # CPU bf16 matmuls round differently on strided inputs, so keep that layout (one small copy).
        return EmbeddedContext(torch.cat([img, text], dim=1), img.shape[1])

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_hidden_states_image: torch.Tensor | None = None,
        step_cache: BatchStepCache | None = None,
        context: EmbeddedContext | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for video latents.

        Args:
            hidden_states: latents (batch, in_channels, frames, height, width); for I2V the pipeline's
                channel concat [noisy latents (16); frame mask (4); condition latents (16)].
            timestep: (batch,) or (1,), the scheduler's timestep in [0, 1000] (not sigma), one per row;
                rows may be at different steps. A (batch, seq) tensor gives each patch token its own
                timestep (Wan 2.2 TI2V-style inputs; seq = post-patch frames * height * width).
            encoder_hidden_states: UMT5 states (batch, txt_seq, text_dim); Wan pads them to 512 with
                zeros and passes no mask.
            encoder_hidden_states_image: CLIP image states (batch, 257, image_dim) for I2V models
                (FLF2V: (2 * batch, 257, image_dim) first/last frame pairs, or (batch, 514, image_dim));
                must be None for T2V models.
            step_cache: rows of approximate-quality requests, which may reuse the blocks' residual from
                an earlier step (`models/step_cache.py`); None runs every block for every row (exact).
            context: `embed_context(encoder_hidden_states, encoder_hidden_states_image)`, given instead
                of both (then None): the text and image states are the same at every step of a request,
                so a caller running many steps embeds them once.

        Returns:
            (batch, out_channels, frames, height, width), in the dtype of `hidden_states`.
        """
        grid = video_patch_grid(hidden_states, self.config.patch_size)
        batch = hidden_states.shape[0]
        seq = math.prod(grid)
        timestep = self._timestep_rows(timestep, batch, seq)
        context = self._context_of(context, encoder_hidden_states, encoder_hidden_states_image)
        ctx, image_len = context.states, context.image_len

        rope = self.rope_tables(*grid, hidden_states.device)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        dtype = x.dtype
        # Diffusers rounds temb to the text states' dtype; the pipeline passes everything in one dtype.
        temb, time_mod = self.condition_embedder.time(timestep, ctx.dtype)
        x = self._blocks_with_step_cache(step_cache, x, ctx, image_len, time_mod, rope)
        return self._output_head(x, temb, dtype, grid, tuple(hidden_states.shape))

    def _context_of(
        self,
        context: EmbeddedContext | None,
        encoder_hidden_states: torch.Tensor | None,
        encoder_hidden_states_image: torch.Tensor | None,
    ) -> EmbeddedContext:
        """`context` as given, or embedded from the text (and image) states; exactly one of the two."""
        if context is None:
            if encoder_hidden_states is None:
                raise ValueError("pass encoder_hidden_states (UMT5 states) or context (embedded)")
            return self.embed_context(encoder_hidden_states, encoder_hidden_states_image)
        if encoder_hidden_states is not None or encoder_hidden_states_image is not None:
            raise ValueError("pass either the text/image states or their embedded context, not both")
        return context

    def _blocks_with_step_cache(
        self,
        step_cache: BatchStepCache | None,
        x: torch.Tensor,
        ctx: torch.Tensor,
        image_len: int,
        time_mod: torch.Tensor,
        rope: RopeTables,
    ) -> torch.Tensor:
        """Every block over `x`, or the step cache's rows reusing an earlier step's residual."""
        return run_with_step_cache(
            step_cache,
            x,
            lambda: self.blocks[0].modulated_input(x, time_mod),
            lambda rows: self._run_blocks(
                take_rows(x, rows), take_rows(ctx, rows), image_len, take_rows(time_mod, rows), rope
            ),
            blocks=lambda: self._block_range(x, ctx, image_len, time_mod, rope),
        )

    def _output_head(
        self,
        x: torch.Tensor,
        temb: torch.Tensor,
        dtype: torch.dtype,
        grid: tuple[int, int, int],
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """The modulated output norm and projection, unpatchified to `shape` (the latents' (batch, C, F, H, W))."""
        batch, _, frames, height, width = shape
        p_t, p_h, p_w = self.config.patch_size
        shift, scale = (self.scale_shift_table.float().unsqueeze(0) + temb.float().unsqueeze(2)).unbind(2)
        x = (self.norm_out(x.float()) * (1 + scale)).add_(shift).to(dtype)
        x = self.proj_out(x)
        # (batch, F', H', W', p_t, p_h, p_w, C) -> (batch, C, F'*p_t, H'*p_h, W'*p_w)
        x = x.reshape(batch, *grid, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(batch, -1, frames, height, width)

    def _run_blocks(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        image_len: int,
        time_mod: torch.Tensor,
        rope: RopeTables,
    ) -> torch.Tensor:
        """Every block over the video tokens; returns the hidden state `norm_out` reads.

        `context` is [image tokens (`image_len`, I2V only); text tokens] per row, split here so that a
        subset of rows keeps the strided-slice layout the blocks see for the whole batch.
        """
        if image_len:
            img, ctx = context[:, :image_len], context[:, image_len:]
        else:
            img, ctx = None, context
        split = sequence_split([x.shape[1]])
        if split is not None:
            return self._run_blocks_split(split, x, ctx, img, time_mod, rope)
        for block in self.blocks:
            x = block(x, ctx, img, time_mod, rope)
        return x

    def _block_range(
        self, x: torch.Tensor, context: torch.Tensor, image_len: int, time_mod: torch.Tensor, rope: RopeTables
    ) -> SequentialBlocks:
        """The blocks as a `BlockRange` for DBCache: one video stream (the text is cross-attention context,
        which no block changes), per-row inputs split as `_run_blocks` splits them."""
        refuse_sequence_parallel(sequence_split([x.shape[1]]), "Wan")

        def row_inputs(rows: torch.Tensor | None) -> tuple:
            rows_context = take_rows(context, rows)
            if image_len:
                img, ctx = rows_context[:, :image_len], rows_context[:, image_len:]
            else:
                img, ctx = None, rows_context
            return ctx, img, take_rows(time_mod, rows)

        def call(i: int, x: torch.Tensor, text: torch.Tensor | None, inputs: tuple) -> tuple:
            ctx, img, rows_time_mod = inputs
            return self.blocks[i](x, ctx, img, rows_time_mod, rope), None

        return SequentialBlocks(len(self.blocks), x, None, row_inputs, call)

    def _run_blocks_split(
        self,
        split: SequenceSplit,
        x: torch.Tensor,
        ctx: torch.Tensor,
        img: torch.Tensor | None,
        time_mod: torch.Tensor,
        rope: RopeTables,
    ) -> torch.Tensor:
        """`_run_blocks` with the video tokens split over the sequence-parallel ranks.

        The 3D grid is flattened in (frame, row, column) order and the RoPE tables have one row per
        flattened token, so cutting the tokens and the tables at the same flat positions keeps every
        token with its own (f, h, w) rotation, whatever the grid. Per-token timesteps (Wan 2.2 TI2V-
        style `time_mod` with one row per token) are cut the same way; per-sample ones broadcast. The
        self-attention gathers the keys (`sequence_attention`), the cross-attention reads the replicated
        text/image keys locally, and the tokens are gathered back at the end."""
        video = 0
        if time_mod.shape[1] != 1:
            time_mod = split.split(video, time_mod, dim=1)
        x, rope = split.split(video, x), split.split_rope(rope)
        with split.attention_scope(x.shape[0], x.device):
            for block in self.blocks:
                x = block(x, ctx, img, time_mod, rope)
        return split.gather(video, x)

    @staticmethod
    def _timestep_rows(timestep: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Timesteps as (batch, 1) (one per sample) or (batch, seq) (one per token)."""
        if timestep.ndim == 0:
            timestep = timestep.reshape(1)
        if timestep.ndim == 1 and timestep.shape[0] in (1, batch):
            return timestep.expand(batch).unsqueeze(1)
        if timestep.ndim == 2 and timestep.shape[0] in (1, batch) and timestep.shape[1] == seq:
            return timestep.expand(batch, seq)
        raise ValueError(
            f"timestep must have shape ({batch},), (1,) or ({batch}, {seq}) (per token), got {tuple(timestep.shape)}"
        )
