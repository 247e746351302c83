"""Qwen-Image transformer (MMDiT), native, loading Diffusers `QwenImageTransformer2DModel` weights unchanged.

Architecture (double-stream blocks only, no single-stream part):

    x    = img_in(packed latents)                        (batch, img_seq, inner)
    ctx  = txt_in(RMSNorm(Qwen2.5-VL states))            (batch, txt_seq, inner)
    temb = MLP(sinusoids(1000 * t))                      (batch, inner)          one per sample
    rope = complex tables from img_shapes and txt_seq    shared by every block
    num_layers x block: text and image keep separate adaLN, projections and MLPs, and attend jointly
        over [text; image] with per-head RMSNorm on q/k and 3-axis RoPE (frame, row, column)
    out  = proj_out(adaLN(x, temb))                      (batch, img_seq, patch_size**2 * out_channels)

RoPE positions: an image of (frames, h, w) patches gets frame positions starting at its index in the
sample's image list (0 for the generated image, 1, 2, ... for edit conditioning images) and *centred*
row/column positions -h//2 ... (h-1)//2 (rounded towards the lower side), so images of different sizes
share a centre. Text tokens sit on the diagonal after the images: text token j has position
`max(h//2, w//2 over the sample's images) + j` on all three axes. Padding text on the right therefore
does not move any real token.

Text padding: `encoder_hidden_states_mask` (batch, txt_seq) marks real tokens; masked keys are excluded
from every query's attention, so padded text cannot reach the image (or the real text) tokens. This is
what lets the engine run the positive and negative CFG branches of several requests, with different
prompt lengths, in one forward.

`zero_cond_t` (Qwen-Image-Edit-2511 style): conditioning-image tokens are modulated with the
embedding of t = 0 (they are clean), the generated image and the text with that of the real t.

Qwen-Image-Layered (`use_layer3d_rope`, `use_additional_t_cond`): a sample's image list is the layers it
generates (the composite first, then each RGBA layer, frame positions 0, 1, 2, ...) followed by the one
input image it decomposes, whose frame position is -1; the text starts after both the largest centred
row/column position and the last layer's index. Its timestep embedding adds a learnt 2-entry embedding
chosen per sample by `additional_t_cond` (Diffusers' pipeline passes 0 for every sample).

Every block is conditioned through adaLN on `temb`, which has one row per sample, so one forward can
serve requests at different timesteps (the engine's step-level batching).

Differences from Diffusers: SiLU(temb) is computed once per forward instead of once per block; the
joint attention mask is built once per forward; RoPE is applied once to the concatenated [text; image]
q/k; the RoPE tables are computed only for the positions used (no 4096-entry table, so no 4096 limit)
and cached per shape; the last block skips its text stream's output projection and MLP, which nothing
reads (as Diffusers' SD3 does with `context_pre_only`). Diffusers uses the first sample's `img_shapes` for the whole batch (it warns when
they differ); here every sample gets its own positions, which only differs when a batch mixes shapes.

Sequence parallelism (Ulysses, Ring, USP: `distributed/sequence_split.py`): with more than one
sequence-parallel rank, `_run_blocks` splits the text and the image stream separately (the image
stream whole: an edit model's conditioning-image tokens are split with the generated image's), and
everything indexed by token the same way: the RoPE tables (each sample's block of rows, when they are
per sample: `SequenceSplit.split_rope`) and `zero_cond_t`'s conditioning-token mask. The text padding mask becomes
the split scope's per-key mask over the text stream (the joint mask's image part is all true), the
joint attention is USP attention over the local [text; image] shards, and the image stream is gathered
back for the output head.

Tensor parallelism (`shard_for_tensor_parallel`, before the weights are read): each TP rank holds 1/T of
the heads and MLP features of every block (both streams' q/k/v by heads and MLP inputs column-parallel,
`to_out.0`, `to_add_out` and the MLP outputs row-parallel: one all-reduce per attention output and per
MLP, two fewer in the last block, whose text output is skipped); the embedders, adaLN projections,
per-head QK-norms and output head stay whole on every rank. TP composes with the sequence split: the
joint attention then moves this rank's heads only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.adaln import AdaLayerNormContinuous
from diffserve.layers.embeddings import TimestepEmbedding
from diffserve.layers.feedforward import FeedForward
from diffserve.layers.joint_attention import RotaryJointAttention
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.residual import fp16_clip, gated_residual
from diffserve.layers.rotary import RopeTables, checked_rope_axes
from diffserve.layers.shape_cache import BoundedCache
from diffserve.layers.tensor_parallel import (
    TensorParallelRank,
)
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.controlnets.residuals import BlockResiduals, ResidualGroups
from diffserve.models.dits.base import DiffusersDiT, DiTConfig, check_tp_divides, shard_blocks
from diffserve.models.dits.input_checks import check_per_sample
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows

# Qwen-Image's `RopeTables` (`layers/rotary.py`) are (seq, head_dim // 2) when every sample has the
# same shapes, else (batch * seq, head_dim // 2), one block of rows per sample.

#: (frames, height, width) of one image, in patches.
ImageShape = tuple[int, int, int]

ROPE_THETA = 10000
NORM_EPS = 1e-6
TIMESTEP_CHANNELS = 256
#: Diffusers multiplies the sinusoid arguments (not the timestep) by this; see `_timestep_sinusoids`.
TIMESTEP_SCALE = 1000
#: Distinct (img_shapes, txt_seq, device) entries kept by the RoPE cache (least recently used evicted).
ROPE_CACHE_SIZE = 64


@dataclass(frozen=True)
class QwenImageTransformerConfig(DiTConfig):
    """The Qwen-Image DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are Qwen-Image's and Qwen-Image-Edit's (Edit-2511 sets `zero_cond_t`). `out_channels`
    None means `in_channels` and is resolved when the config is built; sequences become tuples.
    """

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    def __post_init__(self) -> None:
        if self.guidance_embeds:
            # Diffusers builds no guidance embedder for this class and its forward fails when given
            # guidance, so no working checkpoint sets this.
            raise NotImplementedError("QwenImageTransformer2DModel: guidance_embeds=True is not supported")
        # Three axes: (frame, row, column).
        axes = checked_rope_axes("axes_dims_rope", self.axes_dims_rope, self.attention_head_dim, 3)
        self._normalise(axes_dims_rope=axes, out_channels=self.out_channels or self.in_channels)


def _timestep_sinusoids(timesteps: torch.Tensor, dim: int = TIMESTEP_CHANNELS) -> torch.Tensor:
    """(batch,) t in [0, 1] -> (batch, dim) float32 [cos, sin] features of `1000 * t * freq`.

    The factor 1000 multiplies the fp32 product `t * freq`, not `t`: that is Diffusers' rounding order
    for Qwen-Image (`Timesteps(scale=1000)`), and at angles up to ~1e3 rad the order is visible in fp32.
    """
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / half)
    args = TIMESTEP_SCALE * (timesteps[:, None].float() * freqs[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class QwenTimestepEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)); a module of its own for the `time_text_embed.timestep_embedder` names.

    With `additional` (Qwen-Image-Layered's `use_additional_t_cond`), a learnt embedding of a per-sample
    index in {0, 1} (`addition_t_embedding`) is added to it."""

    def __init__(self, dim: int, additional: bool = False) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, dim)
        self.addition_t_embedding = nn.Embedding(2, dim) if additional else None

    def forward(
        self, timestep: torch.Tensor, dtype: torch.dtype, additional: torch.Tensor | None = None
    ) -> torch.Tensor:
        temb = self.timestep_embedder(_timestep_sinusoids(timestep).to(dtype))
        if self.addition_t_embedding is None:
            return temb
        if additional is None:
            raise ValueError("this Qwen-Image DiT (use_additional_t_cond) needs additional_t_cond")
        # One index per sample; with zero_cond_t's doubled timesteps, the same index for both halves.
        index = additional.to(device=temb.device, dtype=torch.long).reshape(-1)
        if index.shape[0] not in (1, temb.shape[0]):
            index = index.repeat(temb.shape[0] // index.shape[0])
        return temb + self.addition_t_embedding(index).to(dtype)


def _axis_angles(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(n,) int64 positions -> (n, dim // 2) float32 rotation angles of one RoPE axis.

    Built exactly as Diffusers builds its table (fp32 inverse frequencies, int64 x fp32 outer product),
    so every angle, and hence every cos/sin, is bit-identical to the reference.
    """
    inv_freq = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2).to(torch.float32).div(dim))
    return torch.outer(positions, inv_freq)


def _centred(n: int) -> torch.Tensor:
    """Positions -(n - n//2) ... n//2 - 1: centred on the grid, one more on the negative side when n is odd."""
    return torch.arange(-(n - n // 2), n // 2)


class QwenImageRope(nn.Module):
    """Qwen-Image's 3-axis RoPE tables (`scale_rope=True` layout), cached per shape; holds no tensors in the state dict.

    Angles and cos/sin are computed on the CPU in float32 (as Diffusers computes its table at
    construction, on the CPU) and moved to the target device once per cache entry, so repeated
    denoising steps reuse the same device tensors and every device sees the reference bits.
    """

    def __init__(self, axes_dims: Sequence[int], layered: bool = False) -> None:
        """`layered`: Qwen-Image-Layered's positions (`use_layer3d_rope`, see the module docstring)."""
        super().__init__()
        self.axes_dims = tuple(axes_dims)
        self.layered = layered
        self._cache: BoundedCache[RopeTables] = BoundedCache(ROPE_CACHE_SIZE)

    def _sample_angles(self, shapes: tuple[ImageShape, ...], txt_len: int) -> torch.Tensor:
        """(txt_len + image tokens, head_dim // 2) angles for one sample's [text; images]."""
        d_frame, d_row, d_col = self.axes_dims
        images = []
        last = len(shapes) - 1
        for index, (frames, height, width) in enumerate(shapes):
            # Layered: the decomposed input image (the last) sits at frame position -1.
            frame_pos = (
                torch.arange(-frames, 0)
                if self.layered and index == last
                else torch.arange(index, index + frames)
            )
            f = _axis_angles(frame_pos, d_frame)
            h = _axis_angles(_centred(height), d_row)
            w = _axis_angles(_centred(width), d_col)
            grid = (frames, height, width)
            images.append(
                torch.cat(
                    [
                        f[:, None, None].expand(*grid, -1),
                        h[None, :, None].expand(*grid, -1),
                        w[None, None, :].expand(*grid, -1),
                    ],
                    dim=-1,
                ).reshape(frames * height * width, -1)
            )
        start = max(max(h // 2, w // 2) for _, h, w in shapes)
        if self.layered:
            start = max(start, last)
        txt_pos = torch.arange(start, start + txt_len)
        text = torch.cat([_axis_angles(txt_pos, d) for d in self.axes_dims], dim=-1)
        return torch.cat([text, *images], dim=0)

    def forward(
        self, img_shapes: Sequence[tuple[ImageShape, ...]], txt_len: int, device: torch.device
    ) -> RopeTables:
        """Tables for a batch whose sample i has images `img_shapes[i]` and `txt_len` (padded) text tokens.

        `img_shapes` of length 1 serves the whole batch with one (seq, head_dim // 2) table.
        """
        shared = all(s == img_shapes[0] for s in img_shapes)
        samples = (img_shapes[0],) if shared else tuple(img_shapes)

        def build() -> RopeTables:
            angles = torch.cat([self._sample_angles(s, int(txt_len)) for s in samples], dim=0)
            # Diffusers rotates by polar(1, angle) in complex64; its real/imag parts are these cos/sin.
            cis = torch.polar(torch.ones_like(angles), angles)
            return cis.real.contiguous().to(device), cis.imag.contiguous().to(device)

        return self._cache.get_or_build((samples, int(txt_len)), device, build)


class QwenDoubleStreamAttention(RotaryJointAttention):
    """Joint attention over [text; image] (`RotaryJointAttention`) with Diffusers' RMSNorm on q/k and
    RoPE tables that may differ per sample."""

    attend = staticmethod(sequence_attention)  # over this rank's shards when the sequence is split

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__(dim, num_heads, head_dim, lambda: RMSNorm(head_dim, eps=NORM_EPS))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        batch, seq = q.shape[:2]
        if cos.shape[0] == seq:
            return self.rope(q, k, cos, sin)
        # Per-sample tables (batch * seq rows): fold the batch into the sequence, a free view here.
        q, k = self.rope(
            q.reshape(1, batch * seq, *q.shape[2:]), k.reshape(1, batch * seq, *k.shape[2:]), cos, sin
        )
        return q.view(batch, seq, *q.shape[2:]), k.view(batch, seq, *k.shape[2:])


class QwenImageTransformerBlock(nn.Module):
    """Double-stream block. `img_mod`/`txt_mod` keep Diffusers' `Sequential(SiLU, Linear)` names; the model
    passes SiLU(temb) precomputed, so only their Linear (`[1]`) runs here.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.attn = QwenDoubleStreamAttention(dim, num_heads, head_dim)
        self.img_norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.img_mlp = FeedForward(dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_norm1 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.txt_norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.txt_mlp = FeedForward(dim)
        self.modulate = Modulate()

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads of both streams' attention and its slice of both MLPs (see the model's)."""
        for module in (self.attn, self.img_mlp, self.txt_mlp):
            module.shard_for_tensor_parallel(tp)

    def _modulate(
        self, x: torch.Tensor, params: torch.Tensor, cond_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(modulated x, gate broadcastable to x). `params` is (batch, 3 * dim) = [shift, scale, gate].

        With `cond_tokens` (batch, seq) bool, `params` is (2 * batch, 3 * dim): rows [:batch] from the
        real t and rows [batch:] from t = 0; each token picks its half.
        """
        shift, scale, gate = params.chunk(3, dim=-1)
        if cond_tokens is None:
            return self.modulate(x, scale=scale, shift=shift), gate.unsqueeze(1)
        b = x.shape[0]
        sel = cond_tokens.unsqueeze(-1)
        shift, scale, gate = (torch.where(sel, p[b:, None], p[:b, None]) for p in (shift, scale, gate))
        return (x * (1 + scale)).add_(shift), gate

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        temb_act: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None,
        cond_tokens: torch.Tensor | None,
        text_out: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(text, image) after the block. `text_out=False` is for the model's last block, whose text
        stream nothing reads: the text then gives the attention its keys, values and queries, but its
        output projection, residual and MLP are skipped and None is returned in its place."""
        img_params = self.img_mod[1](temb_act)
        # With zero_cond_t, temb_act holds [real t; t = 0] rows; the text uses the real t only.
        txt_params = self.txt_mod[1](temb_act[: x.shape[0]] if cond_tokens is not None else temb_act)
        img_mod1, img_mod2 = img_params.chunk(2, dim=-1)
        txt_mod1, txt_mod2 = txt_params.chunk(2, dim=-1)

        norm_x, img_gate1 = self._modulate(self.img_norm1(x), img_mod1, cond_tokens)
        norm_ctx, txt_gate1 = self._modulate(self.txt_norm1(ctx), txt_mod1)
        attn_x, attn_ctx = self.attn(norm_x, norm_ctx, rope, attn_mask, text_out=text_out)
        x = gated_residual(x, img_gate1, attn_x)
        ff_in, img_gate2 = self._modulate(self.img_norm2(x), img_mod2, cond_tokens)
        x = gated_residual(x, img_gate2, self.img_mlp(ff_in))
        if attn_ctx is None:
            return None, fp16_clip(x)

        ctx = gated_residual(ctx, txt_gate1, attn_ctx)
        ff_in, txt_gate2 = self._modulate(self.txt_norm2(ctx), txt_mod2)
        ctx = gated_residual(ctx, txt_gate2, self.txt_mlp(ff_in))
        return fp16_clip(ctx), fp16_clip(x)


def _per_sample_shapes(img_shapes: Any, batch: int) -> list[tuple[ImageShape, ...]]:
    """Normalise Diffusers' `img_shapes` to one tuple of (f, h, w) per sample (length 1 or `batch`).

    Accepted, as the Diffusers pipelines pass them: a list with one entry per sample, each entry a list
    of (f, h, w) (first the generated image, then any conditioning images) or a single (f, h, w); or a
    bare (f, h, w) for every sample.
    """

    def is_shape(s: Any) -> bool:
        return isinstance(s, Sequence) and len(s) == 3 and all(isinstance(v, numbers.Integral) for v in s)

    if is_shape(img_shapes):
        img_shapes = [img_shapes]
    if not isinstance(img_shapes, Sequence) or len(img_shapes) not in (1, batch):
        raise ValueError(
            f"img_shapes must have one entry per sample ({batch}) or one for all, got {img_shapes!r}"
        )
    out = []
    for entry in img_shapes:
        shapes = [entry] if is_shape(entry) else list(entry)
        if not shapes or not all(is_shape(s) for s in shapes):
            raise ValueError(f"each img_shapes entry must be (frames, h, w) or a list of them, got {entry!r}")
        out.append(tuple((int(f), int(h), int(w)) for f, h, w in shapes))
    return out


class QwenImageTransformer2DModel(DiffusersDiT):
    """Qwen-Image DiT with Diffusers' config keys and state-dict names.

    Built from a `QwenImageTransformerConfig` (`DiffusersDiT`). It holds no buffers; RoPE tables are built on
    first use per shape and cached.
    """

    diffusers_class_name: ClassVar[str] = "QwenImageTransformer2DModel"
    config_class = QwenImageTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: QwenImageTransformerConfig) -> None:
        super().__init__(config)
        inner = config.inner_dim

        self.pos_embed = QwenImageRope(config.axes_dims_rope, layered=config.use_layer3d_rope)
        self.time_text_embed = QwenTimestepEmbedding(inner, additional=config.use_additional_t_cond)
        self.txt_norm = RMSNorm(config.joint_attention_dim, eps=NORM_EPS)
        self.img_in = nn.Linear(config.in_channels, inner)
        self.txt_in = nn.Linear(config.joint_attention_dim, inner)
        self.transformer_blocks = nn.ModuleList(
            [
                QwenImageTransformerBlock(inner, config.num_attention_heads, config.attention_head_dim)
                for _ in range(config.num_layers)
            ]
        )
        self.norm_out = AdaLayerNormContinuous(inner)
        self.proj_out = nn.Linear(inner, config.patch_size * config.patch_size * config.out_channels)

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """Make this model rank `tp.tp_rank`'s shard of a `tp.tp_size`-way tensor-parallel DiT; call it on
        the meta-built model, before the weights are loaded (the loader then reads only the shard).

        Every block's q/k/v projections (image and text) and MLP input projections become column-parallel
        (each rank: heads / T whole heads, MLP features / T), and the attention output and MLP output
        projections row-parallel (their partial sums all-reduced over `tp.tp_group`). Embedders, adaLN
        projections, the per-head QK-norms and the output head are replicated. The heads must divide
        `tp.tp_size` (ValueError naming both)."""
        heads = self.config.num_attention_heads
        check_tp_divides(tp, heads, f"the Qwen-Image DiT's {heads} attention heads do not divide")
        shard_blocks(self, tp, self.transformer_blocks)

    def rope_tables(self, img_shapes: Any, txt_len: int, device: torch.device, batch: int = 1) -> RopeTables:
        """(cos, sin) tables for [text; images]; cached, so calling it every step costs a dict lookup."""
        return self.pos_embed(_per_sample_shapes(img_shapes, batch), txt_len, device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: Any,
        guidance: torch.Tensor | None = None,
        step_cache: BatchStepCache | None = None,
        controlnet_block_samples: Sequence[torch.Tensor] | None = None,
        controlnet_residuals: Sequence[BlockResiduals] | None = None,
        additional_t_cond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for packed latents.

        Args:
            hidden_states: packed latents (batch, img_seq, in_channels); for edit models the generated
                image's tokens followed by the conditioning images' tokens, per `img_shapes`.
            encoder_hidden_states: Qwen2.5-VL states (batch, txt_seq, joint_attention_dim), right-padded.
            encoder_hidden_states_mask: (batch, txt_seq) bool/int, true/nonzero for real tokens; None when
                no row is padded.
            timestep: (batch,) or (1,) in [0, 1] (sigma, i.e. the scheduler's t / 1000), as Diffusers'
                pipeline passes it; each row may differ.
            img_shapes: per sample, a list of (frames, h, w) in patches (generated image first, then
                conditioning images), as Diffusers' pipelines pass it; one entry serves the whole batch.
            guidance: ignored (Qwen-Image is not guidance-distilled); accepted for call compatibility.
            step_cache: rows of approximate-quality requests, which may reuse the blocks' residual from
                an earlier step (`models/step_cache.py`); None runs every block for every row (exact).
                The residual covers every image token (conditioning images too); the signal only the
                generated image's.
            controlnet_block_samples: a ControlNet's residuals for every row, Diffusers' keyword: sample
                `i // ceil(num_layers / len(samples))` is added to the image stream after block `i`.
            controlnet_residuals: instead, residuals of several ControlNet groups, each on its own rows
                (the engine's step batches; `models/controlnets/residuals.py`).
            additional_t_cond: (batch,) or (1,) int in {0, 1}, required by (and only read by) a DiT with
                `use_additional_t_cond` (Qwen-Image-Layered; its pipeline passes 0).

        Returns:
            (batch, img_seq, patch_size**2 * out_channels).
        """
        del guidance
        batch, img_seq = hidden_states.shape[:2]
        txt_seq = encoder_hidden_states.shape[1]
        check_per_sample(batch, timestep=timestep)
        shapes = _per_sample_shapes(img_shapes, batch)
        for sample in shapes:
            tokens = sum(f * h * w for f, h, w in sample)
            if tokens != img_seq:
                raise ValueError(
                    f"img_shapes {list(sample)} give {tokens} image tokens, hidden_states has {img_seq}"
                )

        x = self.img_in(hidden_states)
        # Rounded to the activation dtype first, as Diffusers does (it matters in bf16).
        t = timestep.to(x.dtype).expand(batch)
        cond_tokens = None
        if self.config.zero_cond_t:
            t = torch.cat([t, t * 0])
            cond_tokens = _condition_token_mask(shapes, img_seq, batch, x.device)
        temb_act = F.silu(
            self.time_text_embed(t, x.dtype, additional_t_cond)
        )  # every adaLN projects SiLU(temb)
        ctx = self.txt_in(self.txt_norm(encoder_hidden_states))

        attn_mask = None
        if encoder_hidden_states_mask is not None:
            if encoder_hidden_states_mask.shape != (batch, txt_seq):
                raise ValueError(
                    f"encoder_hidden_states_mask must be ({batch}, {txt_seq}), "
                    f"got {tuple(encoder_hidden_states_mask.shape)}"
                )
            # Key mask over [text; image], broadcast over heads and queries: image keys always visible.
            img_keys = torch.ones(batch, img_seq, dtype=torch.bool, device=x.device)
            attn_mask = torch.cat([encoder_hidden_states_mask.to(torch.bool), img_keys], dim=1)[
                :, None, None, :
            ]

        rope = self.pos_embed(shapes, txt_seq, x.device)
        groups = list(controlnet_residuals or ())
        if controlnet_block_samples:
            groups.append(BlockResiduals(double=list(controlnet_block_samples), single=()))
        controls = ResidualGroups(tuple(groups)) if groups else None
        x = run_with_step_cache(
            step_cache,
            x,
            lambda: self._cache_signal(x, temb_act, cond_tokens, shapes),
            lambda rows: self._run_blocks(
                take_rows(x, rows),
                take_rows(ctx, rows),
                _take_temb_rows(temb_act, rows, batch),
                _take_rope_rows(rope, rows, txt_seq + img_seq),
                _take_optional_rows(attn_mask, rows),
                _take_optional_rows(cond_tokens, rows),
                None if controls is None else controls.take(rows),
            ),
            blocks=lambda: self._block_range(x, ctx, temb_act, rope, attn_mask, cond_tokens, batch, controls),
        )

        x = self.norm_out(x, temb_act[:batch])
        return self.proj_out(x)

    def _run_blocks(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        temb_act: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None,
        cond_tokens: torch.Tensor | None,
        controls: ResidualGroups | None = None,
    ) -> torch.Tensor:
        """Every double-stream block; returns the image tokens the output head reads. `controls`: the
        ControlNet residuals of some rows, added to the image stream after each block.

        The last block skips its text stream's output (`text_out=False`): nothing reads it.
        """
        split = sequence_split([ctx.shape[1], x.shape[1]])
        if split is not None:
            return self._run_blocks_split(split, x, ctx, temb_act, rope, attn_mask, cond_tokens, controls)
        last = len(self.transformer_blocks) - 1
        for i, block in enumerate(self.transformer_blocks):
            ctx, x = block(x, ctx, temb_act, rope, attn_mask, cond_tokens, text_out=i < last)
            if controls is not None:
                x = controls.add("double", i, last + 1, x)
        return x

    def _block_range(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        temb_act: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None,
        cond_tokens: torch.Tensor | None,
        batch: int,
        controls: ResidualGroups | None = None,
    ) -> SequentialBlocks:
        """The blocks as a `BlockRange` for DBCache, with `_run_blocks`' per-row inputs and last block."""
        refuse_sequence_parallel(sequence_split([ctx.shape[1], x.shape[1]]), "Qwen-Image")
        blocks, last, seq = (
            self.transformer_blocks,
            len(self.transformer_blocks) - 1,
            ctx.shape[1] + x.shape[1],
        )

        def row_inputs(rows: torch.Tensor | None) -> tuple:
            return (
                _take_temb_rows(temb_act, rows, batch),
                _take_rope_rows(rope, rows, seq),
                _take_optional_rows(attn_mask, rows),
                _take_optional_rows(cond_tokens, rows),
                None if controls is None else controls.take(rows),
            )

        def call(i: int, x: torch.Tensor, ctx: torch.Tensor | None, inputs: tuple) -> tuple:
            *block_inputs, row_controls = inputs
            ctx, x = blocks[i](x, ctx, *block_inputs, text_out=i < last)
            if row_controls is not None:
                x = row_controls.add("double", i, last + 1, x)
            return x, ctx

        return SequentialBlocks(len(blocks), x, ctx, row_inputs, call)

    def _run_blocks_split(
        self,
        split: SequenceSplit,
        x: torch.Tensor,
        ctx: torch.Tensor,
        temb_act: torch.Tensor,
        rope: RopeTables,
        attn_mask: torch.Tensor | None,
        cond_tokens: torch.Tensor | None,
        controls: ResidualGroups | None = None,
    ) -> torch.Tensor:
        """`_run_blocks` with the text and image streams split over the sequence-parallel ranks: every
        block runs on this rank's shards (RoPE rows and conditioning-token flags split with them), the
        joint attention gathers the keys (`sequence_attention`, the text padding as its key mask), and
        the image stream is gathered back at the end. `controls` (whole-sequence ControlNet residuals):
        each rank adds the slice of every sample that matches its image shard."""
        text, image = 0, 1
        batch, txt_len = x.shape[0], ctx.shape[1]
        # The joint key mask is [text padding mask; all true]: only its text part is a real mask.
        text_mask = None if attn_mask is None else attn_mask[:, 0, 0, :txt_len]
        rope = split.split_rope(rope)
        if cond_tokens is not None:
            cond_tokens = split.split(image, cond_tokens)  # padding rows: False (real t), dropped anyway
        x, ctx = split.split(image, x), split.split(text, ctx)
        if controls is not None:
            controls = controls.map_tokens(lambda sample: split.split(image, sample))
        last = len(self.transformer_blocks) - 1
        with split.attention_scope(batch, x.device, [text_mask, None]):
            for i, block in enumerate(self.transformer_blocks):
                ctx, x = block(x, ctx, temb_act, rope, None, cond_tokens, text_out=i < last)
                if controls is not None:
                    x = controls.add("double", i, last + 1, x)
        return split.gather(image, x)

    def _cache_signal(
        self,
        x: torch.Tensor,
        temb_act: torch.Tensor,
        cond_tokens: torch.Tensor | None,
        shapes: list[tuple[ImageShape, ...]],
    ) -> torch.Tensor:
        """The first block's timestep-modulated input of the generated image's tokens (what the step cache
        watches change). Conditioning-image tokens are zeroed: they are the same at every step (and, with
        `zero_cond_t`, so is their modulation), so they would only dilute the change, and an edit request
        would then reuse more than a text-to-image one at the same threshold.
        """
        block = self.transformer_blocks[0]
        img_mod1 = block.img_mod[1](temb_act).chunk(2, dim=-1)[0]
        signal, _ = block._modulate(block.img_norm1(x), img_mod1, cond_tokens)
        batch, img_seq = x.shape[:2]
        if all(math.prod(sample[0]) == img_seq for sample in shapes):
            return signal
        condition = _condition_token_mask(shapes, img_seq, batch, x.device)
        return signal.masked_fill(condition.unsqueeze(-1), 0)


def _condition_token_mask(
    shapes: list[tuple[ImageShape, ...]], img_seq: int, batch: int, device: torch.device
) -> torch.Tensor:
    """(batch, img_seq) bool, true for conditioning-image tokens (those after the generated image's)."""
    n_gen = torch.tensor([math.prod(s[0]) for s in shapes], device=device)
    return (torch.arange(img_seq, device=device)[None, :] >= n_gen[:, None]).expand(batch, -1)


def _take_optional_rows(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else take_rows(t, rows)


def _take_temb_rows(temb_act: torch.Tensor, rows: torch.Tensor | None, batch: int) -> torch.Tensor:
    """SiLU(temb) for batch rows `rows`; with `zero_cond_t` it holds [real t; t = 0] halves, both kept."""
    if rows is None or temb_act.shape[0] == batch:
        return take_rows(temb_act, rows)
    return torch.cat([temb_act.index_select(0, rows), temb_act.index_select(0, rows + batch)])


def _take_rope_rows(rope: RopeTables, rows: torch.Tensor | None, seq: int) -> RopeTables:
    """Shared (seq, d) tables stay; per-sample ones (a `seq` block per row, see `RopeTables`) keep `rows`' blocks."""
    cos, sin = rope
    if rows is None or cos.shape[0] == seq:
        return rope
    return (
        cos.unflatten(0, (-1, seq)).index_select(0, rows).flatten(0, 1),
        sin.unflatten(0, (-1, seq)).index_select(0, rows).flatten(0, 1),
    )
