"""Chroma transformer (lodestones' FLUX.1-schnell derivative), native, loading Diffusers
`ChromaTransformer2DModel` weights unchanged.

Architecture: FLUX.1's DiT (`models/dits/flux.py`) with its conditioning replaced:

    x   = x_embedder(packed latents)                      (batch, img_seq, inner)
    ctx = context_embedder(T5 states)                     (batch, txt_seq, inner)
    mods = approximator(sinusoids(t), sinusoids(0), sinusoids(1000 * index))
                                                          (batch, n_mods, inner)   one per sample
    num_layers x FLUX double-stream block, adaLN vectors read from `mods` (no projection of its own)
    num_single_layers x FLUX single-stream block, likewise
    out = proj_out(adaLN(x, mods[-2:]))

There is no pooled text vector and no timestep MLP: the "distilled guidance layer" (an MLP of
`approximator_layers` RMS-normed residual SiLU layers) maps, for every modulation index, the timestep's
sinusoids, the (always zero) guidance's sinusoids and the index's own sinusoids to one adaLN vector. The
vectors are laid out as [single blocks: 3 each][double blocks' image stream: 6 each][double blocks' text
stream: 6 each][output head: shift, scale].

T5's padding is masked the way Diffusers' ChromaPipeline does it: the mask over [text; image] (1 for the
prompt's tokens, one padding token and every image token) enters attention as the additive bias
`mask_q * mask_k`, so a kept query's scores are raised by 1 on every kept key, and a masked (padding)
query attends unbiased. It is a bias, not a hard mask; it is what the checkpoints were made for.

The blocks are FLUX.1's (`FluxTransformerBlock`, `FluxSingleTransformerBlock`: same weights, same
maths, the same fused projections and last-block shortcut) with their adaLN projections pruned.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): as FLUX.1's, the text and image
streams are split over the sequence-parallel ranks, every block runs on this rank's shards (the last
single-stream block whole, without its image-rows shortcut) and the image stream is gathered before the
output head. The text-padding bias `mask_q * mask_k` is not a per-key mask, which is all the split
attention takes, but it is rank one: `token_bias_attention` carries it in extra channels of every head
(q gets mask_q, k gets mask_k), so it travels with the shards through the all-to-all and the ring and the
scores get exactly the bias. Exact in fp32; in half precision q's scaling by sqrt((d + 8) / d) rounds once
more than on one device. With one sequence-parallel rank nothing changes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.adaln import ADALN_EPS, AdaLayerNormZero
from diffserve.layers.embeddings import TextProjection, timestep_sinusoids
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm
from diffserve.layers.rotary import RopeTables, checked_rope_axes
from diffserve.layers.tensor_parallel import TensorParallelRank
from diffserve.models.dits.base import DiTConfig, check_tp_divides, shard_blocks
from diffserve.models.dits.block_inputs import run_streams_with_step_cache
from diffserve.models.dits.flux import (
    ROPE_AXES,
    AdaLayerNormZeroSingle,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)
from diffserve.models.dits.flux_streams import FluxStreamsDiT
from diffserve.models.dits.input_checks import check_one_text_input, check_per_sample
from diffserve.models.step_cache import BatchStepCache, take_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChromaTransformerConfig(DiTConfig):
    """The Chroma DiT's Diffusers config (`transformer/config.json`), one field per key; the defaults are
    Chroma1-HD's. `out_channels` None means `in_channels`; sequences become tuples. Refused at load, as
    configs Diffusers' class builds but cannot run: `axes_dims_rope` without one entry per position-id
    axis, and `approximator_num_channels` that four sinusoid blocks cannot fill."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    approximator_num_channels: int = 64
    approximator_hidden_dim: int = 5120
    approximator_layers: int = 5

    def __post_init__(self) -> None:
        axes = checked_rope_axes("axes_dims_rope", self.axes_dims_rope, self.attention_head_dim, ROPE_AXES)
        channels = self.approximator_num_channels
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 4 or channels % 4:
            # The approximator's input is four sinusoid blocks of channels // 4 each (timestep, guidance,
            # and the index's two halves): any other width cannot meet its in_proj.
            raise ValueError(
                f"ChromaTransformer2DModel: approximator_num_channels must be a positive multiple of 4, "
                f"got {channels!r}"
            )
        self._normalise(axes_dims_rope=axes, out_channels=self.out_channels or self.in_channels)

    @property
    def modulation_count(self) -> int:
        """adaLN vectors per sample: 3 per single-stream block, 2 x 6 per double-stream block, 2 for the head."""
        return 3 * self.num_single_layers + 2 * 6 * self.num_layers + 2


# ---------------------------------------------------------------------------------------- layers


class PrunedAdaLayerNorm(nn.Module):
    """An adaLN without its projection (the vectors come from the approximator): the affine-free
    LayerNorm and the modulation that every pruned adaLN below applies to them."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = LayerNorm(dim, eps=ADALN_EPS, elementwise_affine=False)
        self.modulate = Modulate()


class PrunedAdaLayerNormZero(PrunedAdaLayerNorm):
    """A double-stream block's adaLN-Zero without its projection: the vectors come from the approximator.
    (modulated x, gate_msa, shift_mlp, scale_mlp, gate_mlp) from (batch, 6 * dim), as FLUX's."""

    modulate_projected = AdaLayerNormZero.modulate_projected


class PrunedAdaLayerNormZeroSingle(PrunedAdaLayerNorm):
    """A single-stream block's adaLN-Zero without its projection: (modulated x, gate) from (batch, 3 * dim)."""

    modulate_projected = AdaLayerNormZeroSingle.modulate_projected


class PrunedAdaLayerNormContinuous(PrunedAdaLayerNorm):
    """The output head's adaLN from (batch, 2 * dim) given as (shift, scale): FLUX's order reversed."""

    def modulate_projected(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        shift, scale = emb.to(x.dtype).chunk(2, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift)


#: Channels appended to every head to carry the text-padding bias through a split attention: two carry
#: it, the rest are zeros that keep the head width a multiple of 8 (fused kernels' alignment).
BIAS_CHANNELS = 8


def token_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """`sequence_attention` of (batch, seq, heads, d) q, k, v with the additive bias `mask_q * mask_k`,
    from `token_mask`, the (batch, seq) 0/1 mask of these (this rank's local) tokens: Chroma's text-padding
    bias over a split sequence, where the attention takes per-key masks only.

    The bias is rank one, so it rides in `BIAS_CHANNELS` extra channels of every head: the attention's scale
    becomes 1/sqrt(d'), d' = d + BIAS_CHANNELS, so q's own channels are scaled by sqrt(d' / d), q's extra
    channels hold mask_q and k's mask_k * sqrt(d') (split into a value and its rounding residual in the
    dtype, so the bias is 1 within fp32 rounding even in half precision); v's are zeros, and those output
    channels are dropped. Each score is then q.k / sqrt(d) + mask_q * mask_k."""
    head_dim = q.shape[-1]
    width = head_dim + BIAS_CHANNELS
    root = math.sqrt(width)
    high = torch.tensor(root, dtype=q.dtype).item()
    mask = token_mask.to(q.dtype)[:, :, None, None].expand(*q.shape[:3], 1)
    zeros = q.new_zeros(*q.shape[:3], BIAS_CHANNELS - 2)
    q = torch.cat([q * math.sqrt(width / head_dim), mask, mask, zeros], dim=-1)
    k = torch.cat([k, mask * high, mask * (root - high), zeros], dim=-1)
    v = torch.cat([v, q.new_zeros(*v.shape[:3], BIAS_CHANNELS)], dim=-1)
    return sequence_attention(q, k, v)[..., :head_dim]


def chroma_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """The blocks' attention: `sequence_attention` with the dense (batch, 1, seq, seq) bias of
    `attention_bias` (or none) on one device; with a (batch, local seq) token mask, which only a split
    forward passes, `token_bias_attention`."""
    if attn_mask is not None and attn_mask.ndim == 2:
        return token_bias_attention(q, k, v, attn_mask)
    return sequence_attention(q, k, v, attn_mask)


class ChromaTransformerBlock(FluxTransformerBlock):
    """FLUX.1's double-stream block with its two adaLN projections pruned, attending by `chroma_attention`."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__(dim, num_heads, head_dim)
        self.norm1 = PrunedAdaLayerNormZero(dim)
        self.norm1_context = PrunedAdaLayerNormZero(dim)
        self.attn.attend = chroma_attention


class ChromaSingleTransformerBlock(FluxSingleTransformerBlock):
    """FLUX.1's single-stream block with its adaLN projection pruned, attending by `chroma_attention`."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__(dim, num_heads, head_dim)
        self.norm = PrunedAdaLayerNormZeroSingle(dim)
        self.attn.attend = chroma_attention


class ChromaApproximator(nn.Module):
    """The distilled guidance layer: in_proj, `n_layers` pre-RMS-normed residual SiLU MLPs, out_proj
    (Diffusers' names: `in_proj`, `layers.<i>.linear_1/2`, `norms.<i>.weight`, `out_proj`)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, n_layers: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(in_dim, hidden_dim)
        self.layers = nn.ModuleList([TextProjection(hidden_dim, hidden_dim) for _ in range(n_layers)])
        # torch's RMSNorm (eps: the dtype's machine epsilon), as the checkpoints were trained with.
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_dim) for _ in range(n_layers)])
        self.out_proj = nn.Linear(hidden_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.in_proj(x)
        for layer, norm in zip(self.layers, self.norms, strict=True):
            x = x + layer(norm(x))
        return self.out_proj(x)


def attention_bias(text_mask: torch.Tensor, image_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(batch, 1, seq, seq) additive bias over [text; image] from the (batch, text) 0/1 text mask:
    `mask_q * mask_k`, every image token kept (Diffusers' ChromaPipeline and transformer, exactly)."""
    batch = text_mask.shape[0]
    mask = torch.cat([text_mask.to(dtype), text_mask.new_ones(batch, image_len, dtype=dtype)], dim=1)
    return mask[:, None, None, :] * mask[:, None, :, None]


# ---------------------------------------------------------------------------------------- model


class ChromaBlockInputs(NamedTuple):
    """What the blocks read besides the image and text streams, per forward: the blocks' adaLN vectors of
    these rows (`modulations` order), the RoPE tables (shared by every row) and the rows' text mask
    (`forward`'s `text_mask`; None: no padding bias)."""

    mods: Sequence[torch.Tensor]
    rope: RopeTables
    text_mask: torch.Tensor | None

    def take(self, rows: torch.Tensor | None) -> ChromaBlockInputs:
        """These inputs for batch rows `rows` (None: all)."""
        text_mask = None if self.text_mask is None else take_rows(self.text_mask, rows)
        return ChromaBlockInputs([take_rows(m, rows) for m in self.mods], self.rope, text_mask)


class ChromaTransformer2DModel(FluxStreamsDiT):
    """Chroma DiT (`DiffusersDiT`, from a `ChromaTransformerConfig`). It holds no buffers: the
    approximator's constant inputs are computed (on the CPU, as Diffusers' buffer is) per forward.
    `fuse_for_inference()` fuses the blocks' q/k/v projections as FLUX's; state dicts keep Diffusers' names.
    """

    diffusers_class_name: ClassVar[str] = "ChromaTransformer2DModel"
    config_class = ChromaTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: ChromaTransformerConfig) -> None:
        super().__init__(config)
        inner = config.inner_dim
        self.distilled_guidance_layer = ChromaApproximator(
            config.approximator_num_channels,
            inner,
            config.approximator_hidden_dim,
            config.approximator_layers,
        )
        self._add_streams(ChromaTransformerBlock, ChromaSingleTransformerBlock, PrunedAdaLayerNormContinuous)
        self._fused = False

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads and MLP features of every block, as `FluxTransformer2DModel`'s; the
        approximator, embedders and output head stay whole. Call it on the meta-built model."""
        heads = self.config.num_attention_heads
        check_tp_divides(tp, heads, f"the Chroma DiT's {heads} attention heads do not divide")
        shard_blocks(self, tp, [*self.transformer_blocks, *self.single_transformer_blocks])

    def fuse_for_inference(self) -> None:
        """Fuse each block's q/k/v (with the MLP input in single-stream blocks), as FLUX.1's; once loaded."""
        if self._fused:
            return
        layers = sum(block.attn.fuse_projections() for block in self.transformer_blocks)
        layers += sum(block.fuse_projections() for block in self.single_transformer_blocks)
        self._fused = True
        logger.info("Chroma DiT: fused QKV in %d attention layers", layers)

    def approximator_input(self, timestep: torch.Tensor) -> torch.Tensor:
        """(batch, modulation_count, approximator_num_channels): per modulation index, the sinusoids of the
        timestep (scaled by 1000) and of a zero guidance, then those of the index x 1000."""
        channels = self.config.approximator_num_channels // 4
        count, batch, dtype = self.config.modulation_count, timestep.shape[0], timestep.dtype
        step = timestep_sinusoids(timestep, channels).to(dtype)
        # Constant inputs on the CPU (Diffusers computes them there: its index table is a buffer made at
        # construction), then moved: bit-identical on every device.
        guidance = timestep_sinusoids(torch.zeros(batch), channels).to(dtype=dtype, device=timestep.device)
        index = timestep_sinusoids(torch.arange(count) * 1000.0, 2 * channels)
        index = index.to(dtype=dtype, device=timestep.device)
        step_guidance = torch.cat([step, guidance], dim=1).unsqueeze(1).expand(batch, count, 2 * channels)
        return torch.cat([step_guidance, index.expand(batch, count, 2 * channels)], dim=-1)

    def modulations(self, timestep: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(the blocks' adaLN vectors in the order the blocks run: image then text per double-stream block,
        then one per single-stream block, each (batch, n * inner); the output head's (batch, 2 * inner))."""
        mods = self.distilled_guidance_layer(self.approximator_input(timestep))
        n_single, n_double = len(self.single_transformer_blocks), len(self.transformer_blocks)
        image_at, text_at = 3 * n_single, 3 * n_single + 6 * n_double
        ordered = []
        for i in range(n_double):
            ordered.append(mods[:, image_at + 6 * i : image_at + 6 * i + 6].flatten(1))
            ordered.append(mods[:, text_at + 6 * i : text_at + 6 * i + 6].flatten(1))
        ordered += [mods[:, 3 * i : 3 * i + 3].flatten(1) for i in range(n_single)]
        return ordered, mods[:, -2:].flatten(1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        text_mask: torch.Tensor | None = None,
        rope: RopeTables | None = None,
        step_cache: BatchStepCache | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for packed latents.

        Args:
            hidden_states: packed image latents (batch, img_seq, in_channels).
            encoder_hidden_states: T5 states (batch, txt_seq, joint_attention_dim).
            timestep: (batch,) or (1,) sigma in [0, 1]; scaled by 1000 here, as in Diffusers.
            img_ids, txt_ids: position ids (img_seq, 3) and (txt_seq, 3), shared by the batch.
            text_mask: (batch, txt_seq) 1 for the text tokens attention keeps, 0 for masked padding
                (the additive bias of `attention_bias`); None: no bias.
            rope: precomputed `rope_tables(txt_ids, img_ids)`; computed from the ids when None.
            step_cache: rows that may reuse the blocks' residual of an earlier step (whole-span methods).
            context: `embed_context(encoder_hidden_states)`, given instead of `encoder_hidden_states`.

        Returns:
            (batch, img_seq, patch_size**2 * out_channels).
        """
        batch = hidden_states.shape[0]
        check_per_sample(batch, timestep=timestep)
        check_one_text_input(encoder_hidden_states, context, "T5 states")
        if rope is None:
            rope = self.rope_tables(txt_ids, img_ids)
        x = self.x_embedder(hidden_states)
        timestep = timestep.to(x.dtype).expand(batch) * 1000
        block_mods, out_mod = self.modulations(timestep)
        ctx = self.embed_context(encoder_hidden_states) if context is None else context
        inputs = ChromaBlockInputs(block_mods, rope, text_mask)

        def signal() -> torch.Tensor:
            return self.transformer_blocks[0].norm1.modulate_projected(x, block_mods[0])[0]

        x = run_streams_with_step_cache(step_cache, x, ctx, inputs, signal, self._run_blocks)
        return self.proj_out(self.norm_out.modulate_projected(x, out_mod))

    def _run_blocks(self, x: torch.Tensor, ctx: torch.Tensor, inputs: ChromaBlockInputs) -> torch.Tensor:
        """Every block; returns the image tokens the output head reads (the last single-stream block
        computes only those, as FLUX.1's)."""
        split = sequence_split([ctx.shape[1], x.shape[1]])
        if split is not None:
            return self._run_blocks_split(split, x, ctx, inputs)
        mods, rope, text_mask = inputs
        bias = None if text_mask is None else attention_bias(text_mask, x.shape[1], x.dtype)
        mods_iter = iter(mods)
        for block in self.transformer_blocks:
            ctx, x = block(x, ctx, next(mods_iter), next(mods_iter), rope, bias)
        if not self.single_transformer_blocks:
            return x
        text_len = ctx.shape[1]
        h = torch.cat([ctx, x], dim=1)
        *leading, last = self.single_transformer_blocks
        for block in leading:
            h = block(h, next(mods_iter), rope, attn_mask=bias)
        return last(h, next(mods_iter), rope, text_len=text_len, attn_mask=bias)

    def _run_blocks_split(
        self, split: SequenceSplit, x: torch.Tensor, ctx: torch.Tensor, inputs: ChromaBlockInputs
    ) -> torch.Tensor:
        """`_run_blocks` with the text (stream 0) and image (stream 1) tokens split over the sequence-parallel
        ranks (module docstring): the blocks get the local [text; image] token mask in place of the dense
        bias (`chroma_attention`), the last single-stream block runs whole (its image-rows shortcut would give
        queries and keys different lengths), and the image stream is gathered back at the end."""
        text, image = 0, 1
        mods, rope, text_mask = inputs
        token_mask = None
        if text_mask is not None:
            local_text = split.split(text, text_mask.to(x.dtype))
            local_image = local_text.new_ones(x.shape[0], split.shards[image].shard_len)
            token_mask = torch.cat([local_text, local_image], dim=1)
        x, ctx = split.split(image, x), split.split(text, ctx)
        rope = split.split_rope(rope)
        mods_iter = iter(mods)
        with split.attention_scope(x.shape[0], x.device):
            for block in self.transformer_blocks:
                ctx, x = block(x, ctx, next(mods_iter), next(mods_iter), rope, token_mask)
            if self.single_transformer_blocks:
                h = torch.cat([ctx, x], dim=1)
                for block in self.single_transformer_blocks:
                    h = block(h, next(mods_iter), rope, attn_mask=token_mask)
                x = h[:, ctx.shape[1] :]
        return split.gather(image, x)
