"""Z-Image transformer (Alibaba Tongyi), native, loading Diffusers `ZImageTransformer2DModel` weights unchanged.

Architecture (single-stream DiT with per-modality refiners), for the text-to-image path:

    adaln = MLP(sinusoids(t * t_scale))                        (batch, min(dim, 256))   one per sample
    x   = x_embedder(patchify(latent_i))  + pad to SEQ_MULTI_OF with `x_pad_token`     per sample
    n_refiner_layers x noise-refiner block (adaLN-modulated) over image tokens only
    cap = cap_embedder(caption_i)         + pad to SEQ_MULTI_OF with `cap_pad_token`   per sample
    n_refiner_layers x context-refiner block (no modulation) over caption tokens only
    u   = [x_i; cap_i] per sample (padded image tokens first, then padded caption tokens)
    n_layers x main block (adaLN-modulated) over u
    out = unpatchify(final_layer(u_image_part, adaln))

Every block is pre-norm and "sandwich"-normed: RMSNorm before and after both the attention and the
SwiGLU MLP. The modulated blocks scale the pre-norm output by `1 + scale` (there is no shift) and gate
the residual branch by `tanh(gate)`; the modulation vectors come straight from `adaln` (no SiLU in
front of the block projections, unlike the final layer). Attention uses per-head RMSNorm on q/k and
a 3-axis RoPE with complex-multiply (interleaved pair) rotation.

Positions (frame/caption index, row, column): caption token j sits at (1 + j, 0, 0), the tokens that pad
the caption to a multiple of SEQ_MULTI_OF continuing the count; image token (f, h, w) sits at
(C + 1 + f, h, w) where C is the padded caption length; image pad tokens sit at (0, 0, 0). The in-sample
pad tokens are real tokens (they are attended to); only the batch padding that makes samples of different
lengths rectangular is masked out of attention.

Batching: every sample has its own caption length, image size and timestep. The refiners and the main
layers each run once over the whole batch, padded to the longest sample and masked, as Diffusers does.
The gather indices, masks and RoPE tables depend only on the sample shapes and are cached per layout.

Captions are refined once per request: `refine_captions(cap_feats)` runs `cap_embedder` and the context
refiner, which depend on neither the timestep nor the image, and `forward(..., refined_captions=...)`
takes its result in place of `cap_feats` (given `cap_feats`, the forward refines them itself, through
the same method). The pipeline's denoiser refines a request's captions at its first step and keeps them
in `Req.dit_context`.

Step cache (quality tiers and cache methods, `models/step_cache.py`): the cached span is everything
between the refined captions and embedded image tokens and the final layer, i.e. the noise refiner and the
main layers; DBCache runs them in ranges (`z_image_block_range.py`), its Fn and Bn counting the main
layers as cache-dit does. Its input `x` is the embedded, padded image tokens (what the noise refiner transforms) and its
output the image part of the unified sequence after the last main layer, so the reused residual is
"what all the blocks add to the image tokens". Rows that do run are run with the layout of their own
samples (as if they were alone in the batch), so dropping a long-caption request from a step does not
pad the others.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): each stream (the captions
in the context refiner, the image tokens in the noise refiner, the unified sequence in the main layers)
is cut at the same positions for every sample, with its per-sample RoPE tables and key mask; see
`_run_stream_split` and `_run_blocks`. With one sequence-parallel rank nothing changes.

Tensor parallelism (`shard_for_tensor_parallel`, before the weights are read): each TP rank holds 1/T of
the heads and SwiGLU features of every block (main layers and both refiners): q/k/v column-parallel by
heads and `to_out` row-parallel, the MLP's w1/w3 column-parallel and w2 row-parallel (one all-reduce per
attention and per MLP). The QK-norm is per head (an RMSNorm over head_dim), so a rank applies it to its
own heads unchanged; the sandwich RMSNorms, adaLN projections, embedders, pad tokens and final layer
see whole hidden states and are replicated. TP composes with the sequence split: Ulysses and Ring then
move this rank's heads only.

Differences from Diffusers that do not change the numbers: the padded sequences are built with one
gather instead of per-sample concatenation, the image-token padding is inserted after `x_embedder`
(Diffusers embeds copies of the last patch and then overwrites them with the pad token), the final layer
and the last main layer's queries, MLP and output run on the image part of the sequence only, and the batch-padding rows (masked, then discarded) hold
other finite values than Diffusers'. Omni mode (several images per sample, SigLIP features, per-token
noise masks) and ControlNet residuals are not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.attention_weights import AttentionWeights
from diffserve.layers.embeddings import timestep_sinusoids
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.rotary import checked_rope_axes
from diffserve.layers.shape_cache import BoundedCache
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRank,
    shard_linear,
)
from diffserve.models.dits.base import DiffusersDiT, DiTConfig, check_tp_divides, shard_blocks
from diffserve.models.dits.input_checks import check_per_sample
from diffserve.models.dits.z_image_block_range import ZImageBlockRange
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache

#: Sequences (image tokens, caption tokens) are padded per sample to a multiple of this.
SEQ_MULTI_OF = 32
#: Width of the timestep embedding that drives every adaLN projection (capped by `dim`).
ADALN_EMBED_DIM = 256
TIMESTEP_FREQ_DIM = 256
TIMESTEP_MLP_DIM = 1024
QK_NORM_EPS = 1e-5  # fixed in Diffusers, independent of `norm_eps`
FINAL_NORM_EPS = 1e-6
#: Layouts (gather indices, masks, RoPE tables) kept per distinct batch shape (least recently used evicted).
LAYOUT_CACHE_SIZE = 32


@dataclass(frozen=True)
class ZImageTransformerConfig(DiTConfig):
    """The Z-Image DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are Z-Image-Turbo's. Sequences become tuples. `n_kv_heads` is accepted and ignored,
    as in Diffusers: keys and values always have n_heads heads.
    """

    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    siglip_feat_dim: int | None = None
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)

    def __post_init__(self) -> None:
        all_patch_size = tuple(int(p) for p in self.all_patch_size)
        all_f_patch_size = tuple(int(p) for p in self.all_f_patch_size)
        axes_dims = tuple(int(d) for d in self.axes_dims)
        axes_lens = tuple(int(n) for n in self.axes_lens)
        if self.siglip_feat_dim is not None:
            raise ValueError(
                "ZImageTransformer2DModel: siglip_feat_dim is set, i.e. this is a Z-Image Omni checkpoint "
                "(SigLIP image conditioning); only the text-to-image model is implemented natively"
            )
        if len(all_patch_size) != len(all_f_patch_size):
            raise ValueError(
                f"all_patch_size {all_patch_size} and all_f_patch_size {all_f_patch_size} differ in length"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        checked_rope_axes("axes_dims", axes_dims, self.dim // self.n_heads)
        if len(axes_lens) != len(axes_dims) or len(axes_dims) != 3:
            raise ValueError(f"axes_dims {axes_dims} and axes_lens {axes_lens} must both have 3 entries")
        self._normalise(
            all_patch_size=all_patch_size,
            all_f_patch_size=all_f_patch_size,
            axes_dims=axes_dims,
            axes_lens=axes_lens,
        )

    @property
    def inner_dim(self) -> int:
        """The blocks' width, `dim`."""
        return self.dim


def ffn_hidden_width(dim: int) -> int:
    """The SwiGLU MLP's hidden width for model width `dim`, int(dim * 8 / 3) as Diffusers computes it."""
    return int(dim / 3 * 8)


def _round_up(n: int, multiple: int) -> int:
    return n + (-n) % multiple


def rope_axis_tables(
    axes_dims: Sequence[int], axes_lens: Sequence[int], theta: float, device: torch.device
) -> list[torch.Tensor]:
    """Per-axis complex64 rotation tables, table[a][p] = exp(i * p * theta ** (-2k / axes_dims[a])).

    The angles are formed in float64 and rounded to float32 before cos/sin are taken in float32, which is
    how the reference builds them (so the tables match it bit for bit).
    """
    tables = []
    for dim, length in zip(axes_dims, axes_lens, strict=True):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq).float()
        tables.append(torch.polar(torch.ones_like(angles), angles).to(device))
    return tables


def apply_complex_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2k, 2k+1) of x (batch, seq, heads, head_dim) by cis (batch, seq, head_dim // 2).

    The product runs in float32 (complex64) and is rounded back to x's dtype; the tables differ per
    sample because each sample's image positions start after its own caption.
    """
    x_c = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(x_c * cis.unsqueeze(2)).flatten(3).to(x.dtype)


@dataclass(frozen=True)
class _Layout:
    """Everything a forward needs that depends only on the batch's shapes (cached per shape).

    Gather indices read from [sample rows concatenated; pad-token row; zero row]; masks are
    (batch, 1, 1, seq) booleans (True: attend) or None when every sample has the same length, as in
    Diffusers (an all-true mask would select another SDPA kernel).
    """

    sizes: tuple[tuple[int, int, int], ...]  # (F, H, W) latent size per sample
    caption_lengths: tuple[int, ...]
    patch_size: int
    f_patch_size: int
    grids: tuple[tuple[int, int, int], ...]  # (F, H, W) in patches per sample
    image_tokens: tuple[int, ...]
    x_index: torch.Tensor
    x_cis: torch.Tensor
    x_mask: torch.Tensor | None
    caption_width: int  # the longest padded caption: the refined captions' padded batch width
    unified_index: torch.Tensor
    unified_cis: torch.Tensor
    unified_mask: torch.Tensor | None


@dataclass(frozen=True)
class _CaptionLayout:
    """A batch of captions on their own (`refine_captions`): lengths padded to SEQ_MULTI_OF, the gather
    index into [embedded tokens; pad token; zero], RoPE tables and key mask (as in `_Layout`)."""

    padded: tuple[int, ...]
    index: torch.Tensor
    cis: torch.Tensor
    mask: torch.Tensor | None


def _key_mask(lengths: Sequence[int], device: torch.device) -> torch.Tensor | None:
    longest = max(lengths)
    if all(n == longest for n in lengths):
        return None
    valid = torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return valid[:, None, None, :]


def _padded_index(real: Sequence[int], padded: Sequence[int], longest: int) -> torch.Tensor:
    """(batch, longest) rows of [real tokens of all samples; pad token; zero]: sample i's token j, then
    the pad token up to its padded length, then the zero row (batch padding)."""
    total = sum(real)
    index = torch.full((len(real), longest), total + 1, dtype=torch.long)
    start = 0
    for i, (n, p) in enumerate(zip(real, padded, strict=True)):
        index[i, :n] = torch.arange(start, start + n)
        index[i, n:p] = total
        start += n
    return index


def _caption_position_ids(padded_length: int) -> torch.Tensor:
    """(padded_length, 3) positions of a caption's tokens: token j at (1 + j, 0, 0), pad tokens included."""
    ids = torch.zeros(padded_length, 3, dtype=torch.long)
    ids[:, 0] = torch.arange(1, padded_length + 1)
    return ids


class RefinedCaption(NamedTuple):
    """One caption after `cap_embedder` and the context refiner (`refine_captions`): what every step of
    a request reuses, since neither depends on the timestep or the image."""

    states: torch.Tensor  # (length padded to SEQ_MULTI_OF, dim)
    length: int  # real tokens


def _pad_rows(rows: Sequence[torch.Tensor], length: int, fill: int | complex) -> torch.Tensor:
    """Stack 1-D/2-D per-sample tensors along a new batch dim, padding the sequence dim with `fill`."""
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), fill)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


class ZImageAttention(AttentionWeights):
    """Self-attention with per-head RMSNorm on q/k and complex RoPE; no biases (`attention.*` weights)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool) -> None:
        head_dim = dim // num_heads
        norm = partial(RMSNorm, head_dim, eps=QK_NORM_EPS) if qk_norm else None
        super().__init__(dim, num_heads, head_dim, norm, bias=False, out_bias=False)

    def forward(
        self, x: torch.Tensor, cis: torch.Tensor, mask: torch.Tensor | None, query_rows: int | None = None
    ) -> torch.Tensor:
        """Attention over x; with `query_rows`, only the first `query_rows` positions query (and are returned)."""
        # Contiguous, so the query projection is the same 2-D matmul as for the full sequence.
        x_q, cis_q = (x, cis) if query_rows is None else (x[:, :query_rows].contiguous(), cis[:, :query_rows])
        q = self.to_q(x_q).unflatten(-1, (-1, self.head_dim))
        k = self.to_k(x).unflatten(-1, (-1, self.head_dim))
        v = self.to_v(x).unflatten(-1, (-1, self.head_dim))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = apply_complex_rope(q, cis_q), apply_complex_rope(k, cis)
        # Over every rank's tokens when the sequence is split (`_run_stream_split`); else plain attention.
        return self.to_out[0](sequence_attention(q, k, v, mask).flatten(2))


class ZImageFeedForward(nn.Module):
    """SwiGLU MLP `w2(silu(w1 x) * w3 x)` with hidden width int(dim * 8 / 3), no biases.

    The SiLU and the product are written over `w1 x`, which nothing else reads: the same values without
    two more hidden-width buffers (why that matters on the CPU: `layers/mlp.py`).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = ffn_hidden_width(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's slice of the hidden features: w1 and w3 column-parallel (the SiLU gate is elementwise,
        so it runs on the local slice), w2 row-parallel."""
        for name in ("w1", "w3"):
            shard_linear(self, name, ColumnParallelLinear, tp)
        shard_linear(self, "w2", RowParallelLinear, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x), inplace=True).mul_(self.w3(x)))


class ZImageTransformerBlock(nn.Module):
    """Sandwich-normed attention + SwiGLU block; with `modulation`, scaled by 1 + scale and tanh-gated from adaLN.

    The context refiner uses it without modulation (captions are not conditioned on the timestep).
    """

    def __init__(self, dim: int, num_heads: int, norm_eps: float, qk_norm: bool, modulation: bool) -> None:
        super().__init__()
        self.attention = ZImageAttention(dim, num_heads, qk_norm)
        self.feed_forward = ZImageFeedForward(dim)
        self.attention_norm1 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.attention_norm2 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm2 = RMSNorm(dim, eps=norm_eps)
        self.modulation = modulation
        if modulation:
            # A Sequential of one layer only to keep Diffusers' `adaLN_modulation.0` weight names.
            self.adaLN_modulation = nn.Sequential(nn.Linear(min(dim, ADALN_EMBED_DIM), 4 * dim))

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """This rank's heads of the attention and its slice of the MLP features (see the model's); the
        sandwich norms and the modulation read or produce whole hidden states and stay replicated."""
        self.attention.shard_for_tensor_parallel(tp)
        self.feed_forward.shard_for_tensor_parallel(tp)

    def forward(
        self,
        x: torch.Tensor,
        cis: torch.Tensor,
        mask: torch.Tensor | None,
        adaln: torch.Tensor | None = None,
        keep_rows: int | None = None,
    ) -> torch.Tensor:
        """The block over x (batch, seq, dim).

        `keep_rows` is for the model's last layer, whose caption positions nothing reads: only the first
        `keep_rows` positions (the image tokens) are queried, passed through the MLP and returned; the
        others give the attention their keys and values only. Each kept row is the same sums.
        """
        kept = x if keep_rows is None else x[:, :keep_rows]
        if not self.modulation:
            attn = self.attention(self.attention_norm1(x), cis, mask, query_rows=keep_rows)
            x = kept + self.attention_norm2(attn)
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        if adaln is None:
            raise ValueError("a modulated Z-Image block needs the timestep embedding `adaln`")
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln).unsqueeze(1).chunk(4, dim=2)
        scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
        gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
        attn = self.attention(self.attention_norm1(x) * scale_msa, cis, mask, query_rows=keep_rows)
        x = kept + gate_msa * self.attention_norm2(attn)
        return x + gate_mlp * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * scale_mlp))

    def modulated_attention_input(self, x: torch.Tensor, adaln: torch.Tensor) -> torch.Tensor:
        """The attention input of a modulated block, `attention_norm1(x) * (1 + scale_msa)`: the cheap,
        timestep-aware value the step cache watches (one RMSNorm and one small projection)."""
        if not self.modulation:
            raise ValueError(
                "the context-refiner blocks are not modulated; the step cache watches a modulated one"
            )
        scale_msa = self.adaLN_modulation(adaln).unsqueeze(1).chunk(4, dim=2)[0]
        return self.attention_norm1(x) * (1.0 + scale_msa)


def _run_stream(
    blocks: nn.ModuleList,
    h: torch.Tensor,
    cis: torch.Tensor,
    mask: torch.Tensor | None,
    adaln: torch.Tensor | None = None,
    keep_rows: int | None = None,
) -> torch.Tensor:
    """`blocks` in turn over one padded stream h (batch, seq, dim) with its per-sample RoPE rotations
    cis (batch, seq, head_dim // 2) and key mask (batch, 1, 1, seq) or None.

    Returns h, or with `keep_rows` its first `keep_rows` positions: the last block then queries only
    those (`ZImageTransformerBlock.forward`). Under sequence parallelism the stream is split over the
    ranks (`_run_stream_split`)."""
    if not blocks:
        return h if keep_rows is None else h[:, :keep_rows]
    split = sequence_split([h.shape[1]])
    if split is not None:
        return _run_stream_split(split, blocks, h, cis, mask, adaln, keep_rows)
    *leading, last = blocks
    for block in leading:
        h = block(h, cis, mask, adaln)
    return last(h, cis, mask, adaln, keep_rows=keep_rows)


def _run_stream_split(
    split: SequenceSplit,
    blocks: nn.ModuleList,
    h: torch.Tensor,
    cis: torch.Tensor,
    mask: torch.Tensor | None,
    adaln: torch.Tensor | None,
    keep_rows: int | None,
) -> torch.Tensor:
    """`_run_stream` with the stream split over the sequence-parallel ranks.

    Every sample's tokens sit at the same positions of the padded stream, so one cut of the positions
    serves the whole batch: each rank takes the same positions of h and of the per-sample RoPE tables
    (a sample's rotations stay with its tokens, whatever its own caption offset), and the key mask
    (in-sample pad tokens are real keys; only batch padding is masked) is given to the attention scope
    over the stream's full length, where it joins the shards' own padding mask. The blocks then see no
    mask of their own. The last block runs whole: its `keep_rows` shortcut would give each rank a
    different number of queries, which the all-to-all cannot take. The stream is gathered back."""
    stream = 0
    h, cis = split.split(stream, h), split.split(stream, cis)
    with split.attention_scope(h.shape[0], h.device, [mask]):
        for block in blocks:
            h = block(h, cis, None, adaln)
    h = split.gather(stream, h)
    return h if keep_rows is None else h[:, :keep_rows]


class ZImageFinalLayer(nn.Module):
    """LayerNorm scaled by 1 + Linear(SiLU(adaln)), then the projection to patch pixels."""

    def __init__(self, dim: int, out_features: int) -> None:
        super().__init__()
        self.norm_final = LayerNorm(dim, eps=FINAL_NORM_EPS, elementwise_affine=False)
        self.linear = nn.Linear(dim, out_features)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, ADALN_EMBED_DIM), dim))

    def forward(self, x: torch.Tensor, adaln: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.adaLN_modulation(adaln)
        return self.linear(self.norm_final(x) * scale.unsqueeze(1))


class ZImageTimestepEmbedder(nn.Module):
    """MLP (256 -> 1024 -> out, SiLU) on [cos, sin] timestep sinusoids; `mlp.{0,2}` weight names."""

    def __init__(self, out_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQ_DIM, TIMESTEP_MLP_DIM), nn.SiLU(), nn.Linear(TIMESTEP_MLP_DIM, out_dim)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freqs = timestep_sinusoids(t, TIMESTEP_FREQ_DIM, flip_sin_to_cos=True)
        return self.mlp(freqs.to(self.mlp[0].weight.dtype))


class ZImageTransformer2DModel(DiffusersDiT):
    """Z-Image DiT with Diffusers' config keys and state-dict names (text-to-image path).

    Built from a `ZImageTransformerConfig` (`DiffusersDiT`). It holds no buffers; RoPE tables and batch
    layouts are computed on first use per device and shape.
    """

    diffusers_class_name: ClassVar[str] = "ZImageTransformer2DModel"
    config_class = ZImageTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("noise_refiner", "layers")
    cache_leading_lists: ClassVar[int] = 1  # DBCache's Fn/Bn count the main layers (cache-dit's adapter)

    def __init__(self, config: ZImageTransformerConfig) -> None:
        super().__init__(config)
        all_patch_size, all_f_patch_size = config.all_patch_size, config.all_f_patch_size
        in_channels, dim, n_heads = config.in_channels, config.dim, config.n_heads
        norm_eps, qk_norm, cap_feat_dim = config.norm_eps, config.qk_norm, config.cap_feat_dim
        n_refiner_layers = config.n_refiner_layers

        patch_keys = [f"{p}-{f}" for p, f in zip(all_patch_size, all_f_patch_size, strict=True)]
        self.all_x_embedder = nn.ModuleDict(
            {
                k: nn.Linear(f * p * p * in_channels, dim)
                for k, p, f in zip(patch_keys, all_patch_size, all_f_patch_size, strict=True)
            }
        )
        self.all_final_layer = nn.ModuleDict(
            {
                k: ZImageFinalLayer(dim, p * p * f * in_channels)
                for k, p, f in zip(patch_keys, all_patch_size, all_f_patch_size, strict=True)
            }
        )
        self.noise_refiner = nn.ModuleList(
            [ZImageTransformerBlock(dim, n_heads, norm_eps, qk_norm, True) for _ in range(n_refiner_layers)]
        )
        self.context_refiner = nn.ModuleList(
            [ZImageTransformerBlock(dim, n_heads, norm_eps, qk_norm, False) for _ in range(n_refiner_layers)]
        )
        self.t_embedder = ZImageTimestepEmbedder(min(dim, ADALN_EMBED_DIM))
        self.cap_embedder = nn.Sequential(RMSNorm(cap_feat_dim, eps=norm_eps), nn.Linear(cap_feat_dim, dim))
        self.x_pad_token = nn.Parameter(torch.zeros((1, dim)))
        self.cap_pad_token = nn.Parameter(torch.zeros((1, dim)))
        self.layers = nn.ModuleList(
            [ZImageTransformerBlock(dim, n_heads, norm_eps, qk_norm, True) for _ in range(config.n_layers)]
        )
        self._rope_tables: BoundedCache[list[torch.Tensor]] = BoundedCache()  # one entry per device
        self._layouts: BoundedCache[_Layout] = BoundedCache(LAYOUT_CACHE_SIZE)
        self._caption_layouts: BoundedCache[_CaptionLayout] = BoundedCache(LAYOUT_CACHE_SIZE)

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """Make this model rank `tp.tp_rank`'s shard of a `tp.tp_size`-way tensor-parallel DiT; call it on
        the meta-built model, before the weights are loaded (the loader then reads only the shard).

        Every block (main layers, noise refiner, context refiner) holds n_heads / T whole heads (q/k/v
        column-parallel, `to_out` row-parallel) and 1/T of the SwiGLU hidden features (w1/w3 column,
        w2 row); everything else is replicated (module docstring). The heads and the MLP's hidden width
        must divide `tp.tp_size` (ValueError naming them)."""
        heads, dim = self.config.n_heads, self.config.dim
        hidden = ffn_hidden_width(dim)
        check_tp_divides(tp, heads, f"the Z-Image DiT's {heads} attention heads do not divide")
        check_tp_divides(
            tp,
            hidden,
            f"the Z-Image DiT's MLP hidden width {hidden} (int(dim * 8 / 3), dim={dim}) does not divide",
        )
        shard_blocks(self, tp, [*self.noise_refiner, *self.context_refiner, *self.layers])

    # ----------------------------------------------------------------------------------------- layout

    def _rope(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """(seq, 3) integer positions (on the CPU) -> (seq, head_dim // 2) complex64 rotations on `device`."""
        for axis, length in enumerate(self.config.axes_lens):
            top = int(ids[:, axis].max())
            if top >= length:
                raise ValueError(
                    f"RoPE position {top} on axis {axis} exceeds axes_lens[{axis}] = {length}: "
                    "the caption is too long or the image too large for this model"
                )
        tables = self._rope_tables.get_or_build(
            (),
            device,
            lambda: rope_axis_tables(
                self.config.axes_dims, self.config.axes_lens, self.config.rope_theta, device
            ),
        )
        ids = ids.to(device)
        return torch.cat([tables[a][ids[:, a]] for a in range(len(tables))], dim=-1)

    def batch_layout(
        self,
        sizes: Sequence[tuple[int, int, int]],
        caption_lengths: Sequence[int],
        patch_size: int,
        f_patch_size: int,
        device: torch.device,
    ) -> _Layout:
        """Gather indices, attention masks and RoPE tables for a batch shape (cached; cheap to call)."""
        return self._layouts.get_or_build(
            (tuple(sizes), tuple(caption_lengths), patch_size, f_patch_size),
            device,
            lambda: self._build_layout(sizes, caption_lengths, patch_size, f_patch_size, device),
        )

    def _build_layout(
        self,
        sizes: Sequence[tuple[int, int, int]],
        caption_lengths: Sequence[int],
        patch_size: int,
        f_patch_size: int,
        device: torch.device,
    ) -> _Layout:
        grids, image_tokens, image_padded, cap_padded = [], [], [], []
        x_ids, cap_ids = [], []
        for (f, h, w), n_cap in zip(sizes, caption_lengths, strict=True):
            if f % f_patch_size or h % patch_size or w % patch_size:
                raise ValueError(
                    f"latent size (F={f}, H={h}, W={w}) is not divisible by the patch size "
                    f"(f_patch_size={f_patch_size}, patch_size={patch_size})"
                )
            grid = (f // f_patch_size, h // patch_size, w // patch_size)
            n_img = grid[0] * grid[1] * grid[2]
            cap_len = _round_up(n_cap, SEQ_MULTI_OF)
            img_len = _round_up(n_img, SEQ_MULTI_OF)
            grids.append(grid)
            image_tokens.append(n_img)
            image_padded.append(img_len)
            cap_padded.append(cap_len)

            cap_ids.append(_caption_position_ids(cap_len))
            axes = [torch.arange(n) for n in grid]
            axes[0] = axes[0] + cap_len + 1
            ids = torch.zeros(img_len, 3, dtype=torch.long)  # pad tokens stay at (0, 0, 0)
            ids[:n_img] = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(n_img, 3)
            x_ids.append(ids)

        batch = len(sizes)
        x_len, c_len = max(image_padded), max(cap_padded)
        unified_lengths = [a + b for a, b in zip(image_padded, cap_padded, strict=True)]
        u_len = max(unified_lengths)

        # Unified rows come from [x (batch * x_len); cap (batch * c_len); zero].
        unified_index = torch.full((batch, u_len), batch * (x_len + c_len), dtype=torch.long)
        for i, (a, b) in enumerate(zip(image_padded, cap_padded, strict=True)):
            unified_index[i, :a] = torch.arange(i * x_len, i * x_len + a)
            unified_index[i, a : a + b] = torch.arange(
                batch * x_len + i * c_len, batch * x_len + i * c_len + b
            )

        x_cis = [self._rope(ids, device) for ids in x_ids]
        cap_cis = [self._rope(ids, device) for ids in cap_ids]
        unified_cis = [torch.cat([a, b]) for a, b in zip(x_cis, cap_cis, strict=True)]
        return _Layout(
            sizes=tuple(tuple(s) for s in sizes),
            caption_lengths=tuple(int(n) for n in caption_lengths),
            patch_size=patch_size,
            f_patch_size=f_patch_size,
            grids=tuple(grids),
            image_tokens=tuple(image_tokens),
            x_index=_padded_index(image_tokens, image_padded, x_len).to(device),
            x_cis=_pad_rows(x_cis, x_len, 0),
            x_mask=_key_mask(image_padded, device),
            caption_width=c_len,
            unified_index=unified_index.to(device),
            unified_cis=_pad_rows(unified_cis, u_len, 0),
            unified_mask=_key_mask(unified_lengths, device),
        )

    # ---------------------------------------------------------------------------------------- forward

    def refine_captions(self, cap_feats: Sequence[torch.Tensor]) -> list[RefinedCaption]:
        """The captions through `cap_embedder` and the context refiner, as `forward` would run them.

        Neither depends on the timestep or the image, so a request's captions (its CFG branches
        together, batched and masked as in its own forward) are refined once and every step passes
        them as `refined_captions`: for a single request the states are bit-identical to `forward`'s.
        """
        for ci in cap_feats:
            if ci.ndim != 2 or ci.shape[0] == 0:
                raise ValueError(
                    f"each caption feature tensor must be (len > 0, cap_feat_dim), got {tuple(ci.shape)}"
                )
        lengths = tuple(ci.shape[0] for ci in cap_feats)
        layout = self.caption_layout(lengths, cap_feats[0].device)
        cap = self.cap_embedder(torch.cat(list(cap_feats)))
        # Rows of [embedded tokens; pad token; zero]: each caption's tokens, its pad tokens, batch padding.
        cap = torch.cat([cap, self.cap_pad_token.to(cap.dtype), cap.new_zeros(1, cap.shape[1])])[layout.index]
        cap = _run_stream(self.context_refiner, cap, layout.cis, layout.mask)
        return [
            RefinedCaption(cap[i, :n], length)
            for i, (n, length) in enumerate(zip(layout.padded, lengths, strict=True))
        ]

    def caption_layout(self, lengths: Sequence[int], device: torch.device) -> _CaptionLayout:
        """Gather index, RoPE tables and mask of a batch of captions alone (cached per lengths; cheap to call)."""

        def build() -> _CaptionLayout:
            padded = tuple(_round_up(n, SEQ_MULTI_OF) for n in lengths)
            longest = max(padded)
            return _CaptionLayout(
                padded=padded,
                index=_padded_index(lengths, padded, longest).to(device),
                cis=_pad_rows([self._rope(_caption_position_ids(n), device) for n in padded], longest, 0),
                mask=_key_mask(padded, device),
            )

        return self._caption_layouts.get_or_build(tuple(lengths), device, build)

    def forward(
        self,
        x: Sequence[torch.Tensor],
        t: torch.Tensor,
        cap_feats: Sequence[torch.Tensor] | None = None,
        patch_size: int = 2,
        f_patch_size: int = 1,
        step_cache: BatchStepCache | None = None,
        refined_captions: Sequence[RefinedCaption] | None = None,
    ) -> list[torch.Tensor]:
        """Predict one output latent per sample (the pipeline negates it to get the flow velocity).

        Args:
            x: per-sample latents, each (in_channels, F, H, W) (F = 1 for images); sizes may differ.
            t: (batch,) or (1,) denoising progress in [0, 1] as `ZImagePipeline` passes it:
                t = (1000 - scheduler_timestep) / 1000 = 1 - sigma, so 0 is pure noise and 1 is clean.
                Multiplied by `t_scale` (1000) here. Rows may be at different steps.
            cap_feats: per-sample caption features, each (len_i, cap_feat_dim); lengths may differ.
            refined_captions: `refine_captions(cap_feats)`, given instead of `cap_feats` (exactly one of
                the two): the context refiner then does not run again. Given `cap_feats`, the forward
                calls `refine_captions` itself.
            patch_size, f_patch_size: spatial and temporal patch size; the pair must be one the config
                lists (`all_patch_size`/`all_f_patch_size`).
            step_cache: rows of approximate-quality requests, which may reuse the blocks' residual from
                an earlier step (`models/step_cache.py`); None runs every block for every row (exact).

        Returns:
            list of per-sample tensors shaped like the corresponding `x[i]` (in_channels, F, H, W).
        """
        key = f"{patch_size}-{f_patch_size}"
        if key not in self.all_x_embedder:
            raise ValueError(
                f"patch_size={patch_size}, f_patch_size={f_patch_size} is not one of this model's patch "
                f"sizes {sorted(self.all_x_embedder.keys())}"
            )
        if not x or any(not isinstance(xi, torch.Tensor) for xi in x):
            raise TypeError(
                "x must be a non-empty list of per-sample latent tensors (C, F, H, W); nested lists "
                "(Z-Image Omni) are not supported"
            )
        batch = len(x)
        if (cap_feats is None) == (refined_captions is None):
            raise ValueError("pass exactly one of cap_feats and refined_captions")
        captions = cap_feats if cap_feats is not None else refined_captions
        if len(captions) != batch:
            raise ValueError(f"got {batch} latents but {len(captions)} captions")
        channels = self.config.in_channels
        for xi in x:
            if xi.ndim != 4 or xi.shape[0] != channels:
                raise ValueError(f"each latent must be ({channels}, F, H, W), got {tuple(xi.shape)}")
        check_per_sample(batch, t=t)

        if refined_captions is None:
            refined_captions = self.refine_captions(cap_feats)
        device = x[0].device
        layout = self.batch_layout(
            [tuple(xi.shape[1:]) for xi in x],
            [r.length for r in refined_captions],
            patch_size,
            f_patch_size,
            device,
        )
        adaln = self.t_embedder(t * self.config.t_scale).type_as(x[0])

        # Image tokens: patchify each sample to (tokens, pF * pH * pW * C) in (f, h, w) order, embed all at
        # once as one row per sample (padded to the longest), so per-row LoRA adapters see the batch's rows.
        patches = [
            xi.reshape(xi.shape[0], gf, f_patch_size, gh, patch_size, gw, patch_size)
            .permute(1, 3, 5, 2, 4, 6, 0)
            .reshape(gf * gh * gw, -1)
            for xi, (gf, gh, gw) in zip(x, layout.grids, strict=True)
        ]
        counts = [p.shape[0] for p in patches]
        padded = torch.stack(
            [F.pad(p, (0, 0, 0, max(counts) - n)) for p, n in zip(patches, counts, strict=True)]
        )
        embedded = self.all_x_embedder[key](padded)
        img = torch.cat([e[:n] for e, n in zip(embedded, counts, strict=True)])
        img = torch.cat([img, self.x_pad_token.to(img.dtype), img.new_zeros(1, img.shape[1])])[layout.x_index]
        cap = _pad_rows([r.states for r in refined_captions], layout.caption_width, 0)

        h = run_with_step_cache(
            step_cache,
            img,
            lambda: self._cache_signal(img, adaln),
            lambda rows: self._run_blocks_for_rows(rows, img, cap, adaln, layout),
            blocks=lambda: ZImageBlockRange(
                self.noise_refiner,
                self.layers,
                img,
                cap,
                adaln,
                lambda rows: layout if rows is None else self._rows_layout(rows, layout, img.device),
                SEQ_MULTI_OF,
            ),
        )

        # Image tokens come first in every sample, so the final layer needs only the leading rows.
        out = self.all_final_layer[key](h[:, : max(layout.image_tokens)], adaln)
        c = self.config.in_channels  # the output is a latent like the input
        results = []
        for i, ((f, hh, w), (gf, gh, gw), n) in enumerate(
            zip(layout.sizes, layout.grids, layout.image_tokens, strict=True)
        ):
            results.append(
                out[i, :n]
                .view(gf, gh, gw, f_patch_size, patch_size, patch_size, c)
                .permute(6, 0, 3, 1, 4, 2, 5)
                .reshape(c, f, hh, w)
            )
        return results

    def _run_blocks(
        self, img: torch.Tensor, cap: torch.Tensor, adaln: torch.Tensor, layout: _Layout
    ) -> torch.Tensor:
        """The noise refiner over the image tokens, then the main layers over [image; refined caption] per
        sample.

        Returns the leading `img.shape[1]` positions of the unified sequence, shaped like `img`: every
        sample's (padded) image tokens, which is all the final layer reads. In a sample with fewer image
        tokens than the longest, the positions after its own come from its caption and are never read.

        Under sequence parallelism each stage splits its own stream (`_run_stream`): the image tokens
        are gathered after the noise refiner, the unified sequence is built whole (the caption is
        replicated on every rank) and split again at its own positions, since a sample's image tokens
        keep their positions in it but the two streams' shard boundaries differ (one all-gather of the
        image tokens per forward, against one all-to-all of q, k, v and out per layer).
        """
        img = _run_stream(self.noise_refiner, img, layout.x_cis, layout.x_mask, adaln)
        h = torch.cat([img.flatten(0, 1), cap.flatten(0, 1), img.new_zeros(1, img.shape[-1])])[
            layout.unified_index
        ]
        return _run_stream(
            self.layers, h, layout.unified_cis, layout.unified_mask, adaln, keep_rows=img.shape[1]
        )

    def _run_blocks_for_rows(
        self,
        rows: torch.Tensor | None,
        img: torch.Tensor,
        cap: torch.Tensor,
        adaln: torch.Tensor,
        layout: _Layout,
    ) -> torch.Tensor:
        """`_run_blocks` for batch rows `rows` only (None: all), shaped like `img[rows]`.

        The rows run with the layout of their own samples, not slices of the whole batch's: padding and
        masks are then what those requests get alone, and the padded widths can only shrink, so the
        slices `[:, :width]` of the batch's tokens hold every real and in-sample pad token.
        """
        if rows is None:
            return self._run_blocks(img, cap, adaln, layout)
        own = self._rows_layout(rows, layout, img.device)
        x_len, c_len = own.x_cis.shape[1], own.caption_width
        h = self._run_blocks(
            img.index_select(0, rows)[:, :x_len].contiguous(),
            cap.index_select(0, rows)[:, :c_len].contiguous(),
            adaln if adaln.shape[0] == 1 else adaln.index_select(0, rows),
            own,
        )
        return F.pad(h, (0, 0, 0, img.shape[1] - h.shape[1]))

    def _rows_layout(self, rows: torch.Tensor, layout: _Layout, device: torch.device) -> _Layout:
        """The layout of batch rows `rows` as if they were the whole batch (cached like any layout)."""
        picked = rows.tolist()
        return self.batch_layout(
            [layout.sizes[i] for i in picked],
            [layout.caption_lengths[i] for i in picked],
            layout.patch_size,
            layout.f_patch_size,
            device,
        )

    def _cache_signal(self, img: torch.Tensor, adaln: torch.Tensor) -> torch.Tensor:
        """The first modulated block's attention input on the image tokens: what the step cache watches."""
        first = (
            self.noise_refiner[0]
            if len(self.noise_refiner)
            else (self.layers[0] if len(self.layers) else None)
        )
        if first is None:
            raise ValueError("a Z-Image model without refiner or main layers has no blocks to cache")
        return first.modulated_attention_input(img, adaln)
