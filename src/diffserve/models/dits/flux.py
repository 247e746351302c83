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
concatenating and splitting in every block, RoPE tables are half width, and the single-stream GELU
writes straight into the output projection's input. The last single-stream block computes only
what the output head reads, the image rows: the text rows give it their keys and values, but not
their queries, MLP or output projection (each image row is the same sums). With T5 padded to 512
tokens that saves about 1% of a FLUX.1 step at 256x256 and 0.2% at 1024x1024 (57 blocks), a tenth of
the step of the 6-block 36M-parameter benchmark DiT at 256x256. After `fuse_for_inference()` (the loader calls
it), projections that read the same input are one matmul each: q/k/v per stream, q/k/v with the MLP
input in single-stream blocks, and every block's adaLN projection together; checkpoints keep
Diffusers' names.

Tensor parallelism (`shard_for_tensor_parallel`, before the weights are read): each TP rank holds 1/T of
the heads and MLP features of every block (q/k/v by heads and MLP inputs column-parallel, attention
outputs and MLP outputs row-parallel: one all-reduce per attention and per MLP); the embedders, adaLN
projections, QK-norms and output head stay whole on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.adaln import AdaLayerNormContinuous, AdaLayerNormZero
from diffserve.layers.attention_reuse import ReusableAttention, reused_attention_output
from diffserve.layers.embeddings import CombinedTimestepTextEmbedding
from diffserve.layers.feedforward import FeedForward
from diffserve.layers.fused_linear import FusedLinear
from diffserve.layers.joint_attention import AttentionFn, Heads, RotaryJointAttention
from diffserve.layers.lora_linear import LoraLinear
from diffserve.layers.mlp import gelu_tanh_logistic
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.quantized_linear import linear_rows
from diffserve.layers.residual import attention_mlp_residuals, fp16_clip, gated_residual
from diffserve.layers.rotary import RopeTables, RotaryEmbedding, checked_rope_axes
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
    shard_linear,
)
from diffserve.models.controlnets.residuals import BlockResiduals, ResidualGroups
from diffserve.models.dits.base import DiTConfig, check_tp_divides, shard_blocks
from diffserve.models.dits.block_inputs import run_streams_with_step_cache
from diffserve.models.dits.flux_block_range import FluxBlockRange
from diffserve.models.dits.flux_streams import FluxStreamsDiT
from diffserve.models.dits.input_checks import check_one_text_input, check_per_sample
from diffserve.models.step_cache import BatchStepCache, take_rows

logger = logging.getLogger(__name__)

NORM_EPS = 1e-6
#: Axes of the FLUX.1 position ids (and of `axes_dims_rope`): (index, row, column).
ROPE_AXES = 3


@dataclass(frozen=True)
class FluxTransformerConfig(DiTConfig):
    """The FLUX DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are FLUX.1-dev's and -schnell's (dev sets `guidance_embeds`). `out_channels` None
    means `in_channels` and is resolved when the config is built; sequences become tuples.
    `axes_dims_rope` needs one entry per position-id axis (ROPE_AXES: the pipelines' ids are
    (index, row, column)); Diffusers fails at the first forward on any other count.
    """

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self) -> None:
        axes = checked_rope_axes("axes_dims_rope", self.axes_dims_rope, self.attention_head_dim, ROPE_AXES)
        self._normalise(axes_dims_rope=axes, out_channels=self.out_channels or self.in_channels)


def _qk_norm(head_dim: int) -> RMSNorm:
    """Diffusers' FLUX attention uses torch.nn.RMSNorm for QK-norm (weight multiply in fp32, rounded
    once), i.e. `RMSNorm(round_once=True)`. BFL's original code rounds before the weight; only bf16/fp16
    differ."""
    return RMSNorm(head_dim, eps=NORM_EPS, round_once=True)


def _split_heads(t: torch.Tensor, parts: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """(batch, seq, parts * heads * head_dim) -> `parts` views (batch, seq, heads, head_dim), no copy."""
    return t.unflatten(-1, (parts, -1, head_dim)).unbind(-3)


# ------------------------------------------------------------------------------ projection fusion


def _fuse_linears(owner: nn.Module, fused_name: str, part_names: Sequence[str]) -> nn.Linear:
    """Replace the Linears at `part_names` (dotted paths under `owner`) by one Linear `owner.<fused_name>`.

    The fused Linear's output is the parts' outputs side by side, so one matmul reads the shared
    input once (each output column is the same dot product: on CPU the result is bit-identical).
    The fused weight is allocated once and each part is copied in and then dropped (and the device's
    cached blocks released), so peak memory grows by one group, never by the whole model. State-dict
    hooks on `owner` keep the parts' names: `state_dict()` returns (views of) the parts, and
    `load_state_dict` accepts them.
    """
    sizes, in_features, like = [], None, None
    for name in part_names:
        part = owner.get_submodule(name)
        same_input = in_features in (None, part.in_features)
        if not isinstance(part, nn.Linear) or part.bias is None or not same_input:
            raise TypeError(f"{name}: only biased nn.Linear layers with one input width can be fused")
        if part.weight.is_meta:
            raise RuntimeError(f"{name} has no weights yet: fuse projections after loading the checkpoint")
        sizes.append(part.out_features)
        in_features, like = part.in_features, part.weight
    weight = like.new_empty(sum(sizes), in_features)
    bias = like.new_empty(sum(sizes))
    requires_grad = like.requires_grad
    del like, part
    offset = 0
    with torch.no_grad():
        for name, size in zip(part_names, sizes, strict=True):
            parent, _, leaf = name.rpartition(".")
            holder = owner.get_submodule(parent)
            weight[offset : offset + size].copy_(getattr(holder, leaf).weight)
            bias[offset : offset + size].copy_(getattr(holder, leaf).bias)
            delattr(holder, leaf)  # frees the part now, unless something else holds it
            offset += size
    _release_cached_blocks(weight.device)
    with torch.device("meta"):
        fused = FusedLinear(weight.shape[1], tuple(part_names), tuple(sizes))
    fused.weight = nn.Parameter(weight, requires_grad=requires_grad)
    fused.bias = nn.Parameter(bias, requires_grad=requires_grad)
    setattr(owner, fused_name, fused)
    _keep_part_names(owner, fused_name, tuple(part_names), sizes)
    return fused


def _release_cached_blocks(device: torch.device) -> None:
    """Hand the freed parts' memory back to the device before the next group is fused.

    A caching allocator (CUDA and alike) keeps freed blocks reserved and cannot reuse a part's block
    for a larger fused weight, so without this every fused group would stay reserved twice.
    """
    empty_cache = getattr(getattr(torch, device.type, None), "empty_cache", None)
    if device.type != "cpu" and callable(empty_cache):
        empty_cache()


def _keep_part_names(
    owner: nn.Module, fused_name: str, part_names: tuple[str, ...], sizes: list[int]
) -> None:
    """Checkpoints keep Diffusers' names: split the fused tensors on save, join the parts on load."""

    def split_on_save(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for suffix in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}{fused_name}.{suffix}")
            for name, piece in zip(part_names, fused.split(sizes), strict=True):
                state_dict[f"{prefix}{name}.{suffix}"] = piece

    def join_on_load(
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for suffix in ("weight", "bias"):
            keys = [f"{prefix}{name}.{suffix}" for name in part_names]
            present = [key for key in keys if key in state_dict]
            if len(present) == len(keys):
                joined = torch.cat([state_dict.pop(key) for key in keys])
                state_dict[f"{prefix}{fused_name}.{suffix}"] = joined
            elif present:
                error_msgs.append(
                    f"{prefix}{fused_name} fuses {', '.join(keys)}: they must be loaded together, "
                    f"got only {', '.join(present)}"
                )

    owner.register_state_dict_post_hook(split_on_save)
    owner.register_load_state_dict_pre_hook(join_on_load)


# ---------------------------------------------------------------------------------------- layers


class AdaLayerNormZeroSingle(nn.Module):
    """adaLN-Zero for a single-stream block: (modulated x, gate)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.modulate_projected(x, self.linear(temb_act))

    def modulate_projected(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same, from `emb` = `linear(temb_act)` (batch, 3 * dim)."""
        shift, scale, gate = emb.chunk(3, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift), gate


class FluxJointAttention(RotaryJointAttention):
    """Double-stream attention over [text; image] (`RotaryJointAttention`) with FLUX's QK-norm.

    `fuse_projections()` turns each stream's q/k/v Linears into one (`to_qkv`, `to_added_qkv`, as
    Diffusers' `fuse_qkv_projections` names them); the checkpoint names stay the unfused ones.
    """

    attend = staticmethod(sequence_attention)  # over this rank's shard when the sequence is split

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__(dim, num_heads, head_dim, lambda: _qk_norm(head_dim))
        self.to_qkv: nn.Linear | None = None
        self.to_added_qkv: nn.Linear | None = None

    def fuse_projections(self) -> bool:
        """Fuse q/k/v per stream (after loading); False when already fused."""
        if self.to_qkv is not None:
            return False
        self.to_qkv = _fuse_linears(self, "to_qkv", ("to_q", "to_k", "to_v"))
        self.to_added_qkv = _fuse_linears(self, "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))
        return True

    def project_image(self, x: torch.Tensor) -> Heads:
        if self.to_qkv is None:
            return super().project_image(x)
        q, k, v = _split_heads(self.to_qkv(x), 3, self.head_dim)
        return q, k, v

    def project_text(self, ctx: torch.Tensor) -> Heads:
        if self.to_added_qkv is None:
            return super().project_text(ctx)
        q, k, v = _split_heads(self.to_added_qkv(ctx), 3, self.head_dim)
        return q, k, v


class FluxSelfAttention(ReusableAttention):
    """Single-stream attention's weights and its QK-norm + RoPE + attention; the block projects.

    The block owns the projections' use because it fuses them with its MLP input projection (all
    four read the same modulated input); this module keeps the q/k/v weights under Diffusers' names.
    `attend` is the attention it runs, as `FluxJointAttention.attend` (a DiT built on these blocks may set
    its own on the instance: Chroma's text-padding bias).
    """

    #: Over this rank's shard when the sequence is split.
    attend: AttentionFn = staticmethod(sequence_attention)

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = _qk_norm(head_dim)
        self.norm_k = _qk_norm(head_dim)
        self.rope = RotaryEmbedding()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over projected (batch, seq, heads, head_dim) q, k, v; returns (batch, seq, inner).
        `attn_mask`: broadcastable to (batch, heads, q seq, k seq), bool or an additive bias (None: none)."""
        q, k = self.rope(self.norm_q(q), self.norm_k(k), *rope)
        return self.attend(q, k, v, attn_mask).flatten(2)


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

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads of both streams' attention and its slice of both MLPs (see the model's)."""
        for module in (self.attn, self.ff, self.ff_context):
            module.shard_for_tensor_parallel(tp)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        emb: torch.Tensor,
        emb_ctx: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`emb`/`emb_ctx`: this block's adaLN vectors for image and text (`norm1*.linear(SiLU(temb))`);
        `attn_mask`: over [text; image] (`FluxSelfAttention.forward`'s; None for FLUX.1 itself)."""
        # Each stream's adaLN gives its normalised input and (gate_msa, shift_mlp, scale_mlp, gate_mlp).
        norm_x, *x_mods = self.norm1.modulate_projected(x, emb)
        norm_ctx, *ctx_mods = self.norm1_context.modulate_projected(ctx, emb_ctx)
        attn_x, attn_ctx = self.attn(norm_x, norm_ctx, rope, attn_mask)
        x = attention_mlp_residuals(x, attn_x, x_mods, self.norm2, self.ff, self.modulate)
        ctx = attention_mlp_residuals(
            ctx, attn_ctx, ctx_mods, self.norm2_context, self.ff_context, self.modulate
        )
        return fp16_clip(ctx), x


def _fused_rows(layer: nn.Module, h: torch.Tensor, rows: slice) -> torch.Tensor:
    """`layer(h)[..., rows]` computing only those output rows (a LoRA layer's adapters included; eager
    only): a part of the single-stream block's fused projection."""
    if isinstance(layer, LoraLinear):
        return layer.forward_rows(h, rows)
    return linear_rows(layer, h, rows)


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block on [text; image]: attention and MLP run in parallel from one adaLN input.

    `fuse_projections()` turns q, k, v and the MLP's input projection, which all read the modulated
    input, into one Linear `to_qkv_mlp` (one matmul instead of four).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        mlp_dim = int(dim * mlp_ratio)
        self.head_dim = head_dim
        self.inner_dim = num_heads * head_dim
        self.mlp_dim = mlp_dim
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, mlp_dim)
        self.attn = FluxSelfAttention(dim, num_heads, head_dim)
        self.proj_out = nn.Linear(self.inner_dim + mlp_dim, dim)
        self.to_qkv_mlp: nn.Linear | None = None

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads (q/k/v) and MLP features (`proj_mlp`) column-parallel; `proj_out` row-parallel
        over what they leave here, [local attention; local MLP]: its input columns are this rank's piece
        of the checkpoint's attention columns followed by its piece of the MLP columns (two segments)."""
        for name in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
            shard_linear(self, name, ColumnParallelLinear, tp)
        segments = (self.inner_dim, self.mlp_dim)
        shard_linear(self, "proj_out", RowParallelLinear, tp, segments=segments)
        self.inner_dim //= tp.tp_size
        self.mlp_dim //= tp.tp_size

    def fuse_projections(self) -> bool:
        """Fuse q/k/v and the MLP input projection (after loading); False when already fused."""
        if self.to_qkv_mlp is not None:
            return False
        self.to_qkv_mlp = _fuse_linears(
            self, "to_qkv_mlp", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        )
        return True

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v) with heads split, and the MLP's pre-activation."""
        if self.to_qkv_mlp is not None:
            qkv, mlp = self.to_qkv_mlp(h).split([3 * self.inner_dim, self.mlp_dim], dim=-1)
            return (*_split_heads(qkv, 3, self.head_dim), mlp)
        attn = self.attn
        q, k, v = (p(h).unflatten(-1, (-1, self.head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
        return q, k, v, self.proj_mlp(h)

    def _project_mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP's pre-activation alone (the fused layer's MLP rows only), for a step whose attention
        output is stood in for."""
        layer = self.to_qkv_mlp
        if layer is None:
            return self.proj_mlp(h)
        return _fused_rows(layer, h, slice(3 * self.inner_dim, 3 * self.inner_dim + self.mlp_dim))

    def _project_keys_values(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) alone, heads split: only the fused layer's k/v rows are computed (a contiguous slice of
        its weight, so no copy; an 8-bit layer or one with LoRA adapters computes those rows alone too)."""
        layer = self.to_qkv_mlp
        if layer is not None:
            if isinstance(layer, LoraLinear) and torch.compiler.is_compiling():
                _, k, v, _ = self._project(h)  # the compiled graph sees LoRA layers as one whole op
                return k, v
            kv = _fused_rows(layer, h, slice(self.inner_dim, 3 * self.inner_dim))
            k, v = _split_heads(kv, 2, self.head_dim)
            return k, v
        attn = self.attn
        return attn.to_k(h).unflatten(-1, (-1, self.head_dim)), attn.to_v(h).unflatten(
            -1, (-1, self.head_dim)
        )

    def forward(
        self,
        h: torch.Tensor,
        emb: torch.Tensor,
        rope: RopeTables,
        text_len: int | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`emb`: this block's adaLN vectors (`norm.linear(SiLU(temb))`); `attn_mask`: over [text; image]
        (`FluxSelfAttention.forward`'s; None for FLUX.1 itself).

        `text_len`: set for the model's last block, whose text rows nothing reads. It returns the
        image rows (those after the first `text_len`) only, and computes for the text rows just what
        the image rows need from them: keys and values. Their queries, MLP, attention outputs and
        output projection are skipped (at 256x256 with T5 length 512, two thirds of the block's work).
        Each image row's value is the same sums as in the full block.
        """
        norm_h, gate = self.norm.modulate_projected(h, emb)
        attn = reused_attention_output(self.attn)  # an attention-level cache stands in for it this step
        if attn is not None:
            assert isinstance(attn, torch.Tensor)
            residual = h if text_len is None else h[:, text_len:]
            mlp = self._project_mlp(norm_h if text_len is None else norm_h[:, text_len:].contiguous())
            return self._finish(residual, gate, attn, mlp)
        if text_len is None:
            q, k, v, mlp = self._project(norm_h)
            residual = h
        else:
            # Contiguous halves, as for the double-stream split: strided matmul inputs round
            # differently in bf16 on CPU (free when batch == 1).
            q, k_img, v_img, mlp = self._project(norm_h[:, text_len:].contiguous())
            k_txt, v_txt = self._project_keys_values(norm_h[:, :text_len].contiguous())
            k, v = torch.cat([k_txt, k_img], dim=1), torch.cat([v_txt, v_img], dim=1)
            residual = h[:, text_len:]
            if attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[-2] > 1:
                attn_mask = attn_mask[:, :, text_len:]  # the image rows' queries only
        attn = self.attn(q, k, v, rope, attn_mask)
        return self._finish(residual, gate, attn, mlp)

    def _finish(
        self, residual: torch.Tensor, gate: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor
    ) -> torch.Tensor:
        """The block's output from its attention output and the MLP's pre-activation."""
        if torch.compiler.is_compiling():
            # An out= write into a strided slice breaks the graph in two; inductor fuses the GELU into
            # the concatenation itself.
            joined = torch.cat([attn, gelu_tanh_logistic(mlp)], dim=-1)
            return fp16_clip(gated_residual(residual, gate.unsqueeze(1), self.proj_out(joined)))
        # proj_out reads [attention; GELU(mlp)]: GELU writes its half of that buffer directly instead
        # of into a tensor of its own that a concatenation would then copy (same values, one pass less).
        joined = attn.new_empty(*attn.shape[:-1], self.inner_dim + self.mlp_dim)
        joined[..., : self.inner_dim].copy_(attn)
        torch.ops.aten.gelu.out(mlp, approximate="tanh", out=joined[..., self.inner_dim :])
        return fp16_clip(gated_residual(residual, gate.unsqueeze(1), self.proj_out(joined)))


class FluxBlockInputs(NamedTuple):
    """What the blocks read besides the image and text streams, per forward: the blocks' adaLN vectors of
    these rows (`_modulations` order, without the output head's), the RoPE tables (shared by every row)
    and the ControlNet residuals of these rows (None: no ControlNet)."""

    mods: Sequence[torch.Tensor]
    rope: RopeTables
    controls: ResidualGroups | None = None

    def take(self, rows: torch.Tensor | None) -> FluxBlockInputs:
        """These inputs for batch rows `rows` (None: all)."""
        controls = None if self.controls is None else self.controls.take(rows)
        return FluxBlockInputs([take_rows(m, rows) for m in self.mods], self.rope, controls)


class FluxTransformer2DModel(FluxStreamsDiT):
    """FLUX.1 DiT (`DiffusersDiT`, from a `FluxTransformerConfig`).

    It holds no buffers and computes nothing from parameter values at construction.
    `fuse_for_inference()` (the loader calls it after loading) merges projections for speed; state
    dicts keep Diffusers' names either way.
    """

    diffusers_class_name: ClassVar[str] = "FluxTransformer2DModel"
    config_class = FluxTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: FluxTransformerConfig) -> None:
        super().__init__(config)
        inner = config.inner_dim
        self.time_text_embed = CombinedTimestepTextEmbedding(
            inner, config.pooled_projection_dim, config.guidance_embeds
        )
        self._add_streams(FluxTransformerBlock, FluxSingleTransformerBlock, AdaLayerNormContinuous)
        # Set by `fuse_for_inference()`: every adaLN projection as one Linear, and its output split.
        self.adaln_modulation: nn.Linear | None = None
        self._adaln_sizes: list[int] = []

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """Make this model rank `tp.tp_rank`'s shard of a `tp.tp_size`-way tensor-parallel DiT; call it on
        the meta-built model, before the weights are loaded (the loader then reads only the shard).

        In every block, attention q/k/v (both streams) and the MLP input projections are column-parallel
        (each rank: heads / T whole heads, MLP features / T), and the attention output and MLP output
        projections row-parallel (their partial sums all-reduced over `tp.tp_group`). Embedders, adaLN
        projections, QK-norms and the output head are replicated. `fuse_for_inference()` then fuses the
        local shards. The heads must divide `tp.tp_size` (ValueError naming both)."""
        heads = self.config.num_attention_heads
        check_tp_divides(tp, heads, f"the FLUX DiT's {heads} attention heads do not divide")
        if self.adaln_modulation is not None:  # fused for inference: only after loading
            raise RuntimeError("shard_for_tensor_parallel: call it on the meta-built model, before loading")
        shard_blocks(self, tp, [*self.transformer_blocks, *self.single_transformer_blocks])

    def _block_adaln_projections(self) -> list[tuple[str, nn.Linear]]:
        """(name, Linear) of the blocks' adaLN projections, in the order the forward consumes them."""
        named = []
        for i, block in enumerate(self.transformer_blocks):
            named.append((f"transformer_blocks.{i}.norm1.linear", block.norm1.linear))
            named.append((f"transformer_blocks.{i}.norm1_context.linear", block.norm1_context.linear))
        for i, block in enumerate(self.single_transformer_blocks):
            named.append((f"single_transformer_blocks.{i}.norm.linear", block.norm.linear))
        return named

    def _adaln_projections(self) -> list[tuple[str, nn.Linear]]:
        """(name, Linear) of every adaLN projection of SiLU(temb), in the order the forward consumes them."""
        return [*self._block_adaln_projections(), ("norm_out.linear", self.norm_out.linear)]

    def fuse_for_inference(self) -> None:
        """Fuse projections that read the same input into one matmul each; call once the weights are loaded.

        - per double-stream block, q/k/v of each stream (`attn.to_qkv`, `attn.to_added_qkv`);
        - per single-stream block, q/k/v and the MLP input projection (`to_qkv_mlp`);
        - every adaLN projection of the model (`adaln_modulation`): all blocks' shift/scale/gate
          vectors come from one matmul per forward instead of one per block.

        Fewer, larger matmuls (and kernel launches); on CPU each output is bit-identical to the unfused
        one. Checkpoint names do not change (see `_fuse_linears`). A second call does nothing.
        """
        if self.adaln_modulation is not None:
            return
        attention_layers = sum(block.attn.fuse_projections() for block in self.transformer_blocks)
        attention_layers += sum(block.fuse_projections() for block in self.single_transformer_blocks)
        names, linears = zip(*self._adaln_projections(), strict=True)
        self._adaln_sizes = [linear.out_features for linear in linears]
        del linears  # so that fusing can free each projection as it is copied
        self.adaln_modulation = _fuse_linears(self, "adaln_modulation", names)
        logger.info(
            "FLUX DiT: fused QKV in %d attention layers (single-stream blocks with their MLP input), "
            "%d adaLN projections into one",
            attention_layers,
            len(names),
        )

    def _modulations(self, temb_act: torch.Tensor) -> list[torch.Tensor]:
        """Each adaLN's projection of SiLU(temb), (batch, n * inner) each, in `_adaln_projections` order."""
        if self.adaln_modulation is not None:
            return list(self.adaln_modulation(temb_act).split(self._adaln_sizes, dim=1))
        return [linear(temb_act) for _, linear in self._adaln_projections()]

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        rope: RopeTables | None = None,
        step_cache: BatchStepCache | None = None,
        context: torch.Tensor | None = None,
        controlnet_block_samples: Sequence[torch.Tensor] | None = None,
        controlnet_single_block_samples: Sequence[torch.Tensor] | None = None,
        controlnet_blocks_repeat: bool = False,
        controlnet_rows: Sequence[int] | None = None,
        controlnet_residuals: Sequence[BlockResiduals] | None = None,
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
            context: `embed_context(encoder_hidden_states)`, given instead of `encoder_hidden_states`
                (then None): the T5 states are the same at every step of a request, so a caller running
                many steps embeds them once.
            controlnet_block_samples, controlnet_single_block_samples, controlnet_blocks_repeat: a
                ControlNet's residuals, added to the image stream after the double- / single-stream
                blocks as Diffusers' transformer adds them (`models/controlnets/residuals.py`).
            controlnet_rows: the batch rows those samples belong to, one sample row each (None: every
                row); the other rows run as without a ControlNet.
            controlnet_residuals: instead of the above, residuals of several ControlNet groups, each on
                its own rows (the engine's step batches, `families/flux/controlnet.py`).

        Returns:
            (batch, img_seq, patch_size**2 * out_channels).
        """
        batch = hidden_states.shape[0]
        check_per_sample(batch, timestep=timestep, guidance=guidance)
        if rope is None:
            rope = self.rope_tables(txt_ids, img_ids)

        x = self.x_embedder(hidden_states)
        # Rounded to the activation dtype before scaling, as Diffusers does (it matters in bf16).
        timestep = timestep.to(x.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(x.dtype) * 1000
        temb = self.time_text_embed(timestep, pooled_projections, guidance)
        # Every adaLN projects SiLU(temb): compute it once, and all projections at once when fused.
        *block_mods, out_mod = self._modulations(F.silu(temb))
        check_one_text_input(encoder_hidden_states, context, "T5 states")
        ctx = self.embed_context(encoder_hidden_states) if context is None else context
        groups = list(controlnet_residuals or ())
        if controlnet_block_samples or controlnet_single_block_samples:
            groups.append(
                BlockResiduals(
                    double=list(controlnet_block_samples or ()),
                    single=list(controlnet_single_block_samples or ()),
                    rows=None if controlnet_rows is None else tuple(int(r) for r in controlnet_rows),
                    repeat=controlnet_blocks_repeat,
                )
            )
        inputs = FluxBlockInputs(block_mods, rope, ResidualGroups(tuple(groups)) if groups else None)

        signal = partial(self._cache_signal, x, block_mods)
        x = run_streams_with_step_cache(
            step_cache, x, ctx, inputs, signal, self._run_blocks, self._block_range
        )
        x = self.norm_out.modulate_projected(x, out_mod)
        return self.proj_out(x)

    def _run_blocks(self, x: torch.Tensor, ctx: torch.Tensor, inputs: FluxBlockInputs) -> torch.Tensor:
        """Every double- and single-stream block; returns the image tokens the output head reads.

        `inputs.mods` are the blocks' adaLN vectors (`_modulations` without the output head's);
        `inputs.controls`: the ControlNet residuals of some rows, added after each block.
        """
        split = sequence_split([ctx.shape[1], x.shape[1]])
        if split is not None:
            return self._run_blocks_split(split, x, ctx, inputs)
        mods, rope, controls = inputs
        mods_iter = iter(mods)
        n_double, n_single = len(self.transformer_blocks), len(self.single_transformer_blocks)
        for i, block in enumerate(self.transformer_blocks):
            ctx, x = block(x, ctx, next(mods_iter), next(mods_iter), rope)
            if controls is not None:
                x = controls.add("double", i, n_double, x)
        txt_len = ctx.shape[1]
        if not self.single_transformer_blocks:
            return x
        h = torch.cat([ctx, x], dim=1)
        *leading, last = self.single_transformer_blocks
        for i, block in enumerate(leading):
            h = block(h, next(mods_iter), rope)
            if controls is not None:
                controls.add_in_place("single", i, n_single, h[:, txt_len:])
        x = last(h, next(mods_iter), rope, text_len=txt_len)
        if controls is not None:
            x = controls.add("single", n_single - 1, n_single, x)
        return x

    def _run_blocks_split(
        self, split: SequenceSplit, x: torch.Tensor, ctx: torch.Tensor, inputs: FluxBlockInputs
    ) -> torch.Tensor:
        """`_run_blocks` with the text and image streams split over the sequence-parallel ranks: every
        block runs on this rank's shards, attention gathers the keys (`sequence_attention`), and the image
        stream is gathered back at the end. The last block runs whole (its image-rows-only shortcut would
        give queries and keys different lengths, which the all-to-all cannot take).

        `inputs.controls` (computed over the whole sequence, on every rank): each sample is cut to this
        rank's image shard, so the rank adds the slice matching the tokens it holds (zeros on the shard's
        padding, which the gather drops)."""
        text, image = 0, 1
        mods, rope, controls = inputs
        x, ctx = split.split(image, x), split.split(text, ctx)
        rope = split.split_rope(rope)
        if controls is not None:
            controls = controls.map_tokens(lambda sample: split.split(image, sample))
        mods_iter = iter(mods)
        n_double, n_single = len(self.transformer_blocks), len(self.single_transformer_blocks)
        with split.attention_scope(x.shape[0], x.device):
            for i, block in enumerate(self.transformer_blocks):
                ctx, x = block(x, ctx, next(mods_iter), next(mods_iter), rope)
                if controls is not None:
                    x = controls.add("double", i, n_double, x)
            if self.single_transformer_blocks:
                txt_len = ctx.shape[1]
                h = torch.cat([ctx, x], dim=1)
                for i, block in enumerate(self.single_transformer_blocks):
                    h = block(h, next(mods_iter), rope)
                    if controls is not None:
                        controls.add_in_place("single", i, n_single, h[:, txt_len:])
                x = h[:, txt_len:]
        return split.gather(image, x)

    def _block_range(self, x: torch.Tensor, ctx: torch.Tensor, inputs: FluxBlockInputs) -> FluxBlockRange:
        """The blocks as one sequence for block-range cache methods (DBCache): two adaLN vectors per
        double-stream block, one per single-stream block, in `_modulations` order."""
        mods, rope, controls = inputs
        n_double = len(self.transformer_blocks)
        per_block = [list(mods[2 * i : 2 * i + 2]) for i in range(n_double)]
        per_block += [[m] for m in mods[2 * n_double :]]
        return FluxBlockRange(
            self.transformer_blocks,
            self.single_transformer_blocks,
            x,
            ctx,
            per_block,
            rope,
            controls=controls,
        )

    def _cache_signal(self, x: torch.Tensor, mods: Sequence[torch.Tensor]) -> torch.Tensor:
        """The first block's timestep-modulated image input: what the step cache watches change."""
        if len(self.transformer_blocks):
            return self.transformer_blocks[0].norm1.modulate_projected(x, mods[0])[0]
        return self.single_transformer_blocks[0].norm.modulate_projected(x, mods[0])[0]
