"""Stable Diffusion 3 / 3.5 transformer (MMDiT), native, loading Diffusers `SD3Transformer2DModel` weights unchanged.

Architecture:

    x    = patchify(latents) + crop(sincos position table)    (batch, img_seq, inner)
    ctx  = context_embedder(CLIP-L/G + T5 states)            (batch, txt_seq, inner)
    temb = MLP(t) + MLP(pooled CLIP)                          (batch, inner)        one per sample
    num_layers x joint block: text and image keep separate weights, attend jointly over [image; text];
        SD3.5 "dual attention" blocks (`dual_attention_layers`) add an image-only self-attention (`attn2`);
        the last block is `context_pre_only`: the text stream is only read (keys/values), never updated
    out  = unpatchify(proj_out(adaLN(x, temb)))               (batch, out_channels, H, W)

`forward(..., skip_layers=...)` leaves the listed blocks out for every row (their input passes on
unchanged), as Diffusers' `skip_layers`: skip-layer guidance's extra forward (`families/sd3/pipeline.py`).

Every block is conditioned through adaLN on `temb`, which has one row per sample, so one forward can
serve requests at different timesteps (the engine's step-level batching). Unlike FLUX there is no RoPE:
positions come from a learned-size sincos table stored in the checkpoint (`pos_embed.pos_embed`),
centre-cropped to the latent grid.

Differences from Diffusers that do not change the numbers: SiLU(temb) is computed once per forward
instead of once per block, and the last block queries the image rows only (it never read the text
rows' attention output). At batch 1 the outputs are bit-identical to Diffusers' in fp32 and bf16 (CPU).
At batch > 1 (CFG) Diffusers projects each block's attention output halves as strided views, which
CPU matmuls run more slowly and round differently from the contiguous copies diffserve projects:
about 1e-7 relative in fp32, one ulp in bf16 (`SD3JointAttention.forward`).

Sequence parallelism (Ulysses, Ring, USP: `distributed/sequence_split.py`): with more than one
sequence-parallel rank, `_run_blocks` splits the image and the text stream separately, every block runs
on this rank's shards, the joint attention is USP attention over the local [image; text] shards, and
the image stream is gathered back for the output head. Positions are already in the image tokens (the
sincos table is added before the blocks), so nothing else is per-token. Two things differ from one
device: the last block computes its text queries too (USP needs as many queries as keys; their output
is dropped), and SD3.5's image-only `attn2` runs inside a scope of its own over the image shard alone
(the joint scope's key mask covers [image; text]).

Tensor parallelism (`shard_for_tensor_parallel`, before the weights are read): each TP rank holds 1/T of
the heads and MLP features of every block. The joint attention's q/k/v of both streams and SD3.5's
`attn2` q/k/v are column-parallel by heads, their output projections (`to_out.0`, `to_add_out`)
row-parallel, each MLP column then row: one all-reduce per attention and per MLP. The last block has no
text output projection and no text MLP, so its text stream only gives this rank's heads of keys and
values. SD3.5's QK-norm is per head, so it stays whole on every rank, as do the patch and text
embedders, adaLN projections and the output head. Heads are reshaped by `head_dim`, so a shard's
attention runs over its local heads with no other change. TP composes with the sequence split: Ulysses
and Ring then move this rank's heads only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.adaln import AdaLayerNormContinuous, AdaLayerNormZero
from diffserve.layers.attention_weights import AttentionWeights, QKNormFactory
from diffserve.layers.embeddings import CombinedTimestepTextEmbedding
from diffserve.layers.feedforward import FeedForward
from diffserve.layers.joint_attention import JointAttention
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.shape_cache import BoundedCache
from diffserve.layers.tensor_parallel import (
    TensorParallelRank,
)
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.controlnets.residuals import BlockResiduals, ResidualGroups
from diffserve.models.dits.base import DiffusersDiT, DiTConfig, check_tp_divides, shard_blocks
from diffserve.models.dits.block_inputs import run_streams_with_step_cache
from diffserve.models.dits.input_checks import check_per_sample
from diffserve.models.step_cache import BatchStepCache, take_rows

NORM_EPS = 1e-6
QK_NORMS = (None, "rms_norm", "layer_norm")

#: Makes the scope an attention runs in: `nullcontext` on one device, the image-only sequence-parallel
#: scope for `attn2` when the sequence is split.
ScopeFactory = Callable[[], AbstractContextManager[None]]


@dataclass(frozen=True)
class SD3TransformerConfig(DiTConfig):
    """The SD3 / SD3.5 DiT's Diffusers config (`transformer/config.json`), one field per key.

    SD3-medium: 24 layers, 24 heads, pos_embed_max_size 192; SD3.5-large: 38 layers, 38 heads,
    qk_norm "rms_norm"; SD3.5-medium adds dual_attention_layers 0..12. `out_channels` None means
    `in_channels` and is resolved when the config is built; sequences become tuples.

    A `dual_attention_layers` index outside 0..num_layers - 1 names no block and changes nothing, as in
    Diffusers (which asks each block whether its index is listed): a ControlNet made by Diffusers'
    `SD3ControlNetModel.from_transformer` from SD3.5-medium with 12 layers keeps the DiT's 0..12.
    """

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16
    pos_embed_max_size: int | None = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    def __post_init__(self) -> None:
        if self.caption_projection_dim != self.inner_dim:
            raise ValueError(
                f"caption_projection_dim ({self.caption_projection_dim}) must equal num_attention_heads * "
                f"attention_head_dim ({self.inner_dim}): the projected text joins the image stream"
            )
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"unsupported qk_norm {self.qk_norm!r}; supported: {list(QK_NORMS)}")
        dual = tuple(int(i) for i in self.dual_attention_layers)
        out_channels = self.in_channels if self.out_channels is None else self.out_channels
        self._normalise(dual_attention_layers=dual, out_channels=out_channels)


def sincos_2d_table(
    dim: int, height: int, width: int, base_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """(height * width, dim) float32 2-D sincos position table, row-major over the grid (Diffusers' PatchEmbed).

    Positions are scaled by `base_size / grid_size` per axis. The first half of the channels encodes
    the column, the second half the row; each half is [sin, cos] with frequencies computed in float64.
    """
    if dim % 4:
        raise ValueError(f"the sincos position table needs a hidden size divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float64) / quarter)

    def axis(n: int) -> torch.Tensor:
        pos = torch.arange(n, device=device, dtype=torch.float32) / (n / base_size)
        out = torch.outer(pos.to(torch.float64), omega)
        return torch.cat([out.sin(), out.cos()], dim=1)  # (n, dim / 2)

    cols = axis(width)[None, :, :].expand(height, width, 2 * quarter)
    rows = axis(height)[:, None, :].expand(height, width, 2 * quarter)
    return torch.cat([cols, rows], dim=-1).reshape(height * width, dim).float()


class PatchEmbed(nn.Module):
    """Conv patchify plus the sincos position table, centre-cropped to the latent grid (SD3's PatchEmbed).

    With `pos_embed_max_size` (every SD3 checkpoint) the (1, max*max, dim) table is a persistent buffer, as
    in Diffusers, so the checkpoint's copy is what the model uses; it is also computed here so a model built
    without a checkpoint is complete. Without it the table is computed per grid shape and cached (bounded,
    `BoundedCache`).
    """

    def __init__(
        self, in_channels: int, dim: int, patch_size: int, base_size: int, pos_embed_max_size: int | None
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.base_size = base_size
        self.pos_embed_max_size = pos_embed_max_size
        self.dim = dim
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        if pos_embed_max_size:
            m = pos_embed_max_size
            self.register_buffer(
                "pos_embed", sincos_2d_table(dim, m, m, base_size).unsqueeze(0), persistent=True
            )
        else:
            self.pos_embed = None
        self._tables: BoundedCache[torch.Tensor] = BoundedCache()

    def position_table(self, height: int, width: int, device: torch.device) -> torch.Tensor:
        """(1, height * width, dim) position embedding for a grid of patches."""
        if self.pos_embed is None:
            return self._tables.get_or_build(
                (height, width),
                device,
                lambda: sincos_2d_table(self.dim, height, width, self.base_size, device).unsqueeze(0),
            )
        m = self.pos_embed_max_size
        if height > m or width > m:
            raise ValueError(
                f"latent grid {height}x{width} patches exceeds pos_embed_max_size ({m}); "
                f"the largest image this model supports is {m * self.patch_size} latent pixels per side"
            )
        top, left = (m - height) // 2, (m - width) // 2
        table = self.pos_embed.reshape(1, m, m, -1)[:, top : top + height, left : left + width]
        return table.reshape(1, height * width, -1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.proj(latents)  # (batch, dim, h, w)
        h, w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        # Diffusers adds the (fp32) table and rounds back to the activation dtype.
        return (x + self.position_table(h, w, x.device)).to(x.dtype)


def _qk_norm(kind: str, head_dim: int) -> nn.Module:
    """One per-head QK-norm of SD3.5 (`qk_norm` "rms_norm" or "layer_norm")."""
    if kind == "rms_norm":
        # Diffusers' own RMSNorm here (rounds before the weight in half precision), not torch.nn.RMSNorm.
        return RMSNorm(head_dim, eps=NORM_EPS)
    return LayerNorm(head_dim, eps=NORM_EPS)


def _qk_norm_factory(kind: str | None, head_dim: int) -> QKNormFactory | None:
    return None if kind is None else partial(_qk_norm, kind, head_dim)


def _heads(x: torch.Tensor, proj: nn.Linear, norm: nn.Module | None, head_dim: int) -> torch.Tensor:
    """Project to (batch, seq, heads, head_dim) and apply the optional per-head QK-norm."""
    x = proj(x).unflatten(-1, (-1, head_dim))
    return norm(x) if norm is not None else x


class SD3JointAttention(JointAttention):
    """Joint attention over [image; text], with SD3's optional QK-norm and no RoPE.

    With `context_pre_only` (the last block) there is no `to_add_out`: the text stream supplies keys and
    values only, so its queries are not computed and attention runs for the image rows alone. Diffusers
    computes the text queries and drops their output; SDPA treats query rows independently, so the
    image rows are the same (`tests/unit/test_last_block_trim.py`). At SD3's 333 text tokens that is
    over half of the last block's attention and one text projection. With the sequence split the
    caller asks for the text queries (`text_queries=True`): sequence-parallel attention needs queries
    and keys of one length.

    Attention is `sequence_attention`: plain `attention()` on one device, USP attention over the local
    [image; text] shards inside a split forward's scope.
    """

    def __init__(
        self, dim: int, num_heads: int, head_dim: int, qk_norm: str | None, context_pre_only: bool
    ) -> None:
        norm = _qk_norm_factory(qk_norm, head_dim)
        super().__init__(dim, num_heads, head_dim, norm, context_out=not context_pre_only)
        self.context_pre_only = context_pre_only

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, text_queries: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(image output, text output or None for the last block). `text_queries`: compute the last
        block's text queries too (needed when the sequence is split; the text output is still None)."""
        hd = self.head_dim
        q, k, v = self.image_heads(x)
        if self.to_add_out is None and not text_queries:  # the last block: only the image rows are read
            k = torch.cat([k, _heads(ctx, self.add_k_proj, self.norm_added_k, hd)], dim=1)
            v = torch.cat([v, _heads(ctx, self.add_v_proj, None, hd)], dim=1)
            # Within a split forward this raises (queries and keys differ in length), never miscomputes.
            return self.to_out[0](sequence_attention(q, k, v).flatten(2)), None
        cq, ck, cv = self.text_heads(ctx)
        out = sequence_attention(
            torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
        )
        out = out.flatten(2)
        if self.to_add_out is None:
            return self.to_out[0](out[:, : x.shape[1]].contiguous()), None
        # The halves are strided views when batch > 1, which a CPU linear layer runs as a `bmm`, about 1.5x
        # slower than the contiguous copy's `addmm` (SD3 at 256x256, CFG). Diffusers projects the views
        # (it rounds differently: ~2e-7 in fp32, one ulp in bf16); its compiled graph makes them contiguous.
        x_out, ctx_out = (half.contiguous() for half in out.split([x.shape[1], ctx.shape[1]], dim=1))
        return self.to_out[0](x_out), self.to_add_out(ctx_out)


class SD3SelfAttention(AttentionWeights):
    """Image-only self-attention of SD3.5's dual-attention blocks (`attn2`); `sequence_attention`, so
    within an image-only split scope it attends over every rank's image shard."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, qk_norm: str | None) -> None:
        super().__init__(dim, num_heads, head_dim, _qk_norm_factory(qk_norm, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hd = self.head_dim
        q = _heads(x, self.to_q, self.norm_q, hd)
        k = _heads(x, self.to_k, self.norm_k, hd)
        v = _heads(x, self.to_v, None, hd)
        return self.to_out[0](sequence_attention(q, k, v).flatten(2))


class AdaLayerNormZeroX(nn.Module):
    """SD3.5 adaLN-Zero with a second (shift, scale, gate) triple for `attn2`, from one shared LayerNorm.

    Returns (x for attn, gate_msa, shift_mlp, scale_mlp, gate_mlp, x for attn2, gate_msa2).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 9 * dim)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp, shift2, scale2, gate2 = self.linear(
            temb_act
        ).chunk(9, dim=1)
        normed = self.norm(x)
        x1 = self.modulate(normed, scale=scale, shift=shift)
        x2 = self.modulate(normed, scale=scale2, shift=shift2)
        return x1, gate, shift_mlp, scale_mlp, gate_mlp, x2, gate2


def _gated_add(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return residual + gate.unsqueeze(1) * x


class JointTransformerBlock(nn.Module):
    """MMDiT block: separate adaLN, attention projections and MLPs for image and text, joint attention."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        context_pre_only: bool = False,
        qk_norm: str | None = None,
        use_dual_attention: bool = False,
    ) -> None:
        super().__init__()
        self.context_pre_only = context_pre_only
        self.use_dual_attention = use_dual_attention
        self.norm1 = AdaLayerNormZeroX(dim) if use_dual_attention else AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormContinuous(dim) if context_pre_only else AdaLayerNormZero(dim)
        self.attn = SD3JointAttention(dim, num_heads, head_dim, qk_norm, context_pre_only)
        self.attn2 = SD3SelfAttention(dim, num_heads, head_dim, qk_norm) if use_dual_attention else None
        self.norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff = FeedForward(dim)
        if context_pre_only:
            self.norm2_context = None
            self.ff_context = None
        else:
            self.norm2_context = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
            self.ff_context = FeedForward(dim)
        self.modulate = Modulate()

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads of `attn` (and `attn2`) and its slice of each MLP (see the model's)."""
        self.attn.shard_for_tensor_parallel(tp)
        if self.attn2 is not None:
            self.attn2.shard_for_tensor_parallel(tp)
        for ff in (self.ff, self.ff_context):
            if ff is not None:  # the last block has no text MLP
                ff.shard_for_tensor_parallel(tp)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        temb_act: torch.Tensor,
        text_queries: bool = False,
        self_attention_scope: ScopeFactory = nullcontext,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(text, image) after the block; the text is None after the last (`context_pre_only`) block.

        A split forward passes `text_queries=True` (see `SD3JointAttention`) and, for `attn2`, the
        scope of its image-only sequence-parallel attention."""
        if self.attn2 is not None:
            norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_x2, gate_msa2 = self.norm1(x, temb_act)
        else:
            norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb_act)
        if self.context_pre_only:
            norm_ctx = self.norm1_context(ctx, temb_act)
        else:
            norm_ctx, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(ctx, temb_act)

        attn_x, attn_ctx = self.attn(norm_x, norm_ctx, text_queries)
        x = _gated_add(x, gate_msa, attn_x)
        if self.attn2 is not None:
            with self_attention_scope():
                x = _gated_add(x, gate_msa2, self.attn2(norm_x2))
        ff_in = self.modulate(self.norm2(x), scale=scale_mlp, shift=shift_mlp)
        x = _gated_add(x, gate_mlp, self.ff(ff_in))

        if self.context_pre_only:
            return None, x
        ctx = _gated_add(ctx, c_gate_msa, attn_ctx)
        ff_in = self.modulate(self.norm2_context(ctx), scale=c_scale_mlp, shift=c_shift_mlp)
        ctx = _gated_add(ctx, c_gate_mlp, self.ff_context(ff_in))
        return ctx, x


class BlockInputs(NamedTuple):
    """What the joint blocks read besides the image and text streams, per forward: SiLU(temb) of these
    rows, the block indices every row skips (`forward`'s `skip_layers`) and the ControlNet residuals of
    these rows (None: no ControlNet)."""

    temb_act: torch.Tensor
    skip_layers: frozenset[int]
    controls: ResidualGroups | None

    def take(self, rows: torch.Tensor | None) -> BlockInputs:
        """These inputs for batch rows `rows` (None: all)."""
        controls = None if self.controls is None else self.controls.take(rows)
        return BlockInputs(take_rows(self.temb_act, rows), self.skip_layers, controls)


class SD3Transformer2DModel(DiffusersDiT):
    """SD3 / SD3.5 MMDiT with Diffusers' config keys and state-dict names.

    Built from an `SD3TransformerConfig` (`DiffusersDiT`). Its one buffer, `pos_embed.pos_embed`, is
    persistent (in every SD3 checkpoint).
    """

    diffusers_class_name: ClassVar[str] = "SD3Transformer2DModel"
    config_class = SD3TransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: SD3TransformerConfig) -> None:
        super().__init__(config)
        inner, patch, layers = config.inner_dim, config.patch_size, config.num_layers

        self.pos_embed = PatchEmbed(
            config.in_channels, inner, patch, config.sample_size // patch, config.pos_embed_max_size
        )
        self.time_text_embed = CombinedTimestepTextEmbedding(inner, config.pooled_projection_dim)
        self.context_embedder = nn.Linear(config.joint_attention_dim, config.caption_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            [
                JointTransformerBlock(
                    inner,
                    config.num_attention_heads,
                    config.attention_head_dim,
                    context_pre_only=i == layers - 1,
                    qk_norm=config.qk_norm,
                    use_dual_attention=i in config.dual_attention_layers,
                )
                for i in range(layers)
            ]
        )
        self.norm_out = AdaLayerNormContinuous(inner)
        self.proj_out = nn.Linear(inner, patch * patch * config.out_channels)

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """Make this model rank `tp.tp_rank`'s shard of a `tp.tp_size`-way tensor-parallel DiT; call it on
        the meta-built model, before the weights are loaded (the loader then reads only the shard).

        In every block, the joint attention's q/k/v (both streams), SD3.5's `attn2` q/k/v and the MLP
        input projections are column-parallel (each rank: heads / T whole heads, MLP features / T), and
        the attention and MLP output projections row-parallel (their partial sums all-reduced over
        `tp.tp_group`). Embedders, adaLN projections, the per-head QK-norms and the output head are
        replicated. `tp.tp_size` must divide the heads (ValueError naming both); the MLP width, four
        times heads x head_dim, then divides too."""
        heads = self.config.num_attention_heads
        check_tp_divides(tp, heads, f"the SD3 DiT's {heads} attention heads do not divide")
        shard_blocks(self, tp, self.transformer_blocks)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        step_cache: BatchStepCache | None = None,
        skip_layers: frozenset[int] = frozenset(),
        block_controlnet_hidden_states: Sequence[torch.Tensor] | None = None,
        controlnet_residuals: Sequence[BlockResiduals] | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for latents.

        Args:
            hidden_states: latents (batch, in_channels, H, W); H and W divisible by `patch_size`.
            encoder_hidden_states: joint CLIP + T5 states (batch, txt_seq, joint_attention_dim).
            pooled_projections: pooled CLIP-L + CLIP-G embedding (batch, pooled_projection_dim).
            timestep: (batch,) or (1,) in Diffusers' units (sigma * 1000), used as given.
            step_cache: rows of approximate-quality requests, which may reuse the blocks' residual from
                an earlier step (`models/step_cache.py`); None runs every block for every row (exact).
            skip_layers: block indices that every row skips, passing its image and text states on
                unchanged (skip-layer guidance, Diffusers' `skip_layers`); empty runs every block.
            block_controlnet_hidden_states: a ControlNet's residuals for every row, Diffusers' keyword:
                after block `i` (skipped or not; the last, `context_pre_only` block excepted), sample
                `int(i / (num_blocks / len(samples)))` is added to the image stream.
            controlnet_residuals: instead, residuals of several groups, each on its own rows
                (`models/controlnets/residuals.py`, `truncating` ones).

        Returns:
            (batch, out_channels, H, W).
        """
        batch, _, height, width = hidden_states.shape
        p, out_channels = self.config.patch_size, self.config.out_channels
        if height % p or width % p:
            raise ValueError(
                f"latent height and width must be divisible by patch_size {p}, got {height}x{width}"
            )
        check_per_sample(batch, timestep=timestep)

        x = self.pos_embed(hidden_states)
        temb = self.time_text_embed(timestep, pooled_projections)
        temb_act = F.silu(temb)  # every adaLN projects SiLU(temb); compute it once
        ctx = self.context_embedder(encoder_hidden_states)

        bad = sorted(i for i in skip_layers if not 0 <= i < len(self.transformer_blocks))
        if bad:
            raise ValueError(
                f"skip_layers {bad} are outside the DiT's blocks 0..{len(self.transformer_blocks) - 1}"
            )
        groups = list(controlnet_residuals or ())
        if block_controlnet_hidden_states:
            samples = list(block_controlnet_hidden_states)
            groups.append(BlockResiduals(double=samples, single=(), truncating=True))
        inputs = BlockInputs(temb_act, skip_layers, ResidualGroups(tuple(groups)) if groups else None)
        signal = partial(self._cache_signal, x, temb_act)
        x = run_streams_with_step_cache(
            step_cache, x, ctx, inputs, signal, self._run_blocks, self._block_range
        )

        x = self.proj_out(self.norm_out(x, temb_act))  # (batch, h * w, p * p * out_channels)
        h, w = height // p, width // p
        x = x.reshape(batch, h, w, p, p, out_channels).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(batch, out_channels, height, width)

    def _run_blocks(self, x: torch.Tensor, ctx: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every joint block but `inputs.skip_layers`; returns the image tokens the output head reads (the
        last block drops the text). `inputs.controls`: ControlNet residuals of some rows, added after each
        block but the last."""
        split = sequence_split([x.shape[1], ctx.shape[1]])
        if split is not None:
            return self._run_blocks_split(split, x, ctx, inputs)
        temb_act, skip_layers, controls = inputs
        n = len(self.transformer_blocks)
        for index, block in enumerate(self.transformer_blocks):
            if index not in skip_layers:
                ctx, x = block(x, ctx, temb_act)
            if controls is not None and not block.context_pre_only:
                x = controls.add("double", index, n, x)
        return x

    def _run_blocks_split(
        self, split: SequenceSplit, x: torch.Tensor, ctx: torch.Tensor, inputs: BlockInputs
    ) -> torch.Tensor:
        """`_run_blocks` with the image and text streams split over the sequence-parallel ranks (joint
        order [image; text]): every block runs on this rank's shards, the joint attention and `attn2`
        gather their keys (`sequence_attention`), and the image stream is gathered back at the end.
        `inputs.controls` (whole-sequence ControlNet residuals): each rank adds the slice of every sample
        that matches its image shard."""
        image, text = 0, 1
        temb_act, skip_layers, controls = inputs
        x, ctx = split.split(image, x), split.split(text, ctx)
        if controls is not None:
            controls = controls.map_tokens(lambda sample: split.split(image, sample))
        image_scope = partial(split.stream_scope, image, x.shape[0], x.device)
        n = len(self.transformer_blocks)
        with split.attention_scope(x.shape[0], x.device):
            for index, block in enumerate(self.transformer_blocks):
                if index not in skip_layers:
                    ctx, x = block(x, ctx, temb_act, text_queries=True, self_attention_scope=image_scope)
                if controls is not None and not block.context_pre_only:
                    x = controls.add("double", index, n, x)
        return split.gather(image, x)

    def _block_range(self, x: torch.Tensor, ctx: torch.Tensor, inputs: BlockInputs) -> SequentialBlocks:
        """The joint blocks as a `BlockRange` for DBCache, skipping `inputs.skip_layers` and adding
        `inputs.controls` as `_run_blocks` does."""
        refuse_sequence_parallel(sequence_split([x.shape[1], ctx.shape[1]]), "SD3")
        blocks = self.transformer_blocks

        def call(i: int, x: torch.Tensor, ctx: torch.Tensor | None, rows: BlockInputs) -> tuple:
            temb, skip_layers, row_controls = rows
            if i not in skip_layers:
                ctx, x = blocks[i](x, ctx, temb)
            if row_controls is not None and not blocks[i].context_pre_only:
                x = row_controls.add("double", i, len(blocks), x)
            return x, ctx

        return SequentialBlocks(len(blocks), x, ctx, inputs.take, call)

    def _cache_signal(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        """The first block's timestep-modulated image input: what the step cache watches change."""
        return self.transformer_blocks[0].norm1(x, temb_act)[0]
