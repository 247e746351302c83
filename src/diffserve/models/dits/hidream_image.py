"""HiDream-I1 transformer (HiDream.ai), native, loading Diffusers `HiDreamImageTransformer2DModel` weights
unchanged.

    x    = x_embedder(patchify(latents))                  (batch, image tokens, inner)
    temb = MLP(sinusoids(t)) + MLP(pooled CLIP-L ; CLIP-G)  (batch, inner)
    llama[i] = caption_projection[i](Llama states of layer llama_layers[i])   one per block
    t5   = caption_projection[-1](T5 states)
    text = [t5 ; llama[last]]                            the text stream the double blocks update
    num_layers x double-stream block i: image and [text ; llama[i]] attend jointly, each stream its own
        q/k/v (q, k RMS-normed over the whole width), adaLN from temb (12 vectors), the image stream's
        feed-forward a mixture of experts, the text stream's a SwiGLU; the text keeps its first tokens
    x = [x ; text]
    num_single_layers x single-stream block j: [x ; llama[num_layers + j]] attends, MoE feed-forward;
        the appended Llama tokens are dropped after the block
    out  = final_layer(x's image tokens, temb), unpatchified to (batch, out_channels, height, width)

RoPE: 3-axis FLUX-style rotation over ids (0, row, col) of the image patches and zeros for every text
token; when its axes cover half a head, only the head's first half rotates.

A non-square latent grid is handled as Diffusers (and the original model) does: the patches are padded
with zero tokens to `max_seq` = max_resolution area in patches, and those tokens' keys are zeroed (their
values stay; every token still attends to them). A square grid is not padded.

Mixture of experts (DeepSeek-style, inference path): each token's gate scores are the softmax of
`gate.weight @ x`; its top `num_activated_experts` experts (not renormalised) are summed with those
scores as weights, expert by expert in index order, plus the shared expert. No auxiliary loss (training only).

Timesteps and pooled embeddings are per sample, so requests at different steps share one forward.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): three streams are split over
the sequence-parallel ranks, each on its own: the image tokens (a padded grid's padding included), the
text stream [T5 ; last Llama layer] and the per-block Llama tokens (every block's `llama[i]` has the same
length and is cut alike). Each rank keeps its shards in the joint order [image ; text ; Llama] (the order
of the RoPE tables, which are cut alike), so a double-stream block's text is [text shard ; Llama shard]
and keeps its first (text shard) tokens, and a single-stream block's input is [image shard ; text shard ;
Llama shard]. The attention is `sequence_attention` with the shards' padding masked; the padded grid's
key zeroing is per token, so each rank zeroes its own keys. The image tokens are gathered before the
output head. With one sequence-parallel rank nothing changes.

Step cache (`models/step_cache.py`, the cache methods by name): the whole-span methods reuse the residual
of every block; DBCache runs the blocks in ranges (`HiDreamBlockRange`) counted as cache-dit's HiDream
adapter counts them: the double-stream blocks, then the single-stream ones. Block-range methods are
refused under sequence parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.attention_reuse import ReusableAttention
from diffserve.layers.embeddings import TimestepEmbedding, timestep_sinusoids
from diffserve.layers.lora_rows import LoraRows, current_lora_rows, lora_rows_scope
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.rotary import RopeTables, RotaryEmbedding, multi_axis_rope_tables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.cache_methods.blocks import Streams, refuse_sequence_parallel
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.block_inputs import run_streams_with_step_cache
from diffserve.models.step_cache import BatchStepCache, take_rows

#: Diffusers' fixed constants: the blocks' LayerNorm eps, the q/k RMSNorms' eps, the sinusoid width of
#: the timestep embedding, the SwiGLU hidden rounding and the RoPE base.
BLOCK_EPS = 1e-6
QK_EPS = 1e-5
TIME_FREQUENCIES = 256
SWIGLU_MULTIPLE = 256
ROPE_THETA = 10000.0
ROPE_CACHE_SIZE = 8


@dataclass(frozen=True)
class HiDreamImageTransformerConfig(DiTConfig):
    """The HiDream-I1 DiT's Diffusers config (`transformer/config.json`), one field per key, Diffusers'
    defaults (`patch_size`, `caption_channels` and `llama_layers` have none: a checkpoint states them)."""

    patch_size: int | None = None
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 16
    num_single_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 20
    caption_channels: Sequence[int] | None = None
    text_emb_dim: int = 2048
    num_routed_experts: int = 4
    num_activated_experts: int = 2
    axes_dims_rope: Sequence[int] = (32, 32)
    max_resolution: Sequence[int] = (128, 128)
    llama_layers: Sequence[int] | None = None
    #: Training-only switch in Diffusers (the inference path of the MoE and the unpatchify); inference
    #: always takes that path, so it changes nothing here.
    force_inference_output: bool = False

    def __post_init__(self) -> None:
        self._normalise(
            out_channels=self.out_channels or self.in_channels,
            axes_dims_rope=tuple(int(d) for d in self.axes_dims_rope),
            max_resolution=tuple(int(r) for r in self.max_resolution),
            caption_channels=None if self.caption_channels is None else tuple(self.caption_channels),
            llama_layers=None if self.llama_layers is None else tuple(int(i) for i in self.llama_layers),
        )

    def check(self) -> None:
        """What a checkpoint's config must state for the model to be built (raises ValueError)."""
        name = "HiDreamImageTransformer2DModel"
        if self.patch_size is None or self.caption_channels is None or self.llama_layers is None:
            raise ValueError(f"{name}: patch_size, caption_channels and llama_layers must be set")
        if len(self.caption_channels) != 2:
            raise ValueError(
                f"{name}: caption_channels must be (T5 width, Llama width), got {self.caption_channels}"
            )
        blocks = self.num_layers + self.num_single_layers
        if len(self.llama_layers) != blocks:
            raise ValueError(
                f"{name}: llama_layers must name one Llama layer per block ({blocks}), got {len(self.llama_layers)}"
            )
        axes = self.axes_dims_rope
        if len(axes) != 3 or any(d % 2 for d in axes):
            raise ValueError(f"{name}: axes_dims_rope must be three even widths, got {axes}")
        if sum(axes) not in (self.attention_head_dim, self.attention_head_dim // 2):
            raise ValueError(
                f"{name}: axes_dims_rope {axes} must sum to attention_head_dim ({self.attention_head_dim}) or half of it"
            )
        if self.num_routed_experts and not 0 < self.num_activated_experts <= self.num_routed_experts:
            raise ValueError(f"{name}: num_activated_experts must be in [1, num_routed_experts]")

    @property
    def max_seq(self) -> int:
        """The patch count a non-square grid is padded to (also the pipeline's schedule-shift length)."""
        assert self.patch_size is not None
        height, width = self.max_resolution
        return height * width // (self.patch_size * self.patch_size)


def swiglu_width(hidden_dim: int) -> int:
    """Diffusers' SwiGLU hidden width: two thirds of `hidden_dim`, rounded up to a multiple of 256."""
    width = int(2 * hidden_dim / 3)
    return SWIGLU_MULTIPLE * ((width + SWIGLU_MULTIPLE - 1) // SWIGLU_MULTIPLE)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), bias-free (Diffusers' `HiDreamImageFeedForwardSwiGLU`)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        width = swiglu_width(hidden_dim)
        self.w1 = nn.Linear(dim, width, bias=False)
        self.w2 = nn.Linear(width, dim, bias=False)
        self.w3 = nn.Linear(dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEGate(nn.Module):
    """Softmax gate: each token's top-k experts and their (unnormalised) scores."""

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, dim) / dim**0.5)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, dim) -> (tokens, k) expert indices and their weights, in the tokens' dtype."""
        scores = F.linear(tokens, self.weight).softmax(dim=-1)
        weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return experts, weights


class MoEFeedForward(nn.Module):
    """Routed SwiGLU experts plus a shared one (Diffusers' `MOEFeedForwardSwiGLU`, inference path).

    Each expert runs on the tokens routed to it, gathered from the whole batch. Under per-request LoRA
    (a scope over the batch's rows, layers/lora_rows.py) the expert's batch is those tokens, each one
    row carrying the adapters of the batch row it came from, so adapters on the routed experts apply to
    their own requests' tokens only."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.shared_experts = SwiGLU(dim, hidden_dim // 2)
        self.experts = nn.ModuleList([SwiGLU(dim, hidden_dim) for _ in range(num_experts)])
        self.gate = MoEGate(dim, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(tokens)
        k = experts.shape[1]
        flat_experts, flat_weights = experts.reshape(-1), weights.reshape(-1, 1)
        order = flat_experts.argsort()
        counts = flat_experts.bincount(minlength=len(self.experts)).tolist()  # one host read per layer
        lora = current_lora_rows()
        # Per-request adapters: the batch row of each routed token, in routing order (a second host read,
        # only for batches with LoRA rows).
        batch_rows = (order // k // (tokens.shape[0] // x.shape[0])).tolist() if _per_row(lora) else None
        routed = torch.zeros_like(tokens)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                picks = order[start : start + count]
                rows = picks // k
                if batch_rows is None:
                    out = expert(tokens[rows])
                else:
                    with lora_rows_scope(lora.picked(batch_rows[start : start + count])):
                        out = expert(tokens[rows])
                out = out * flat_weights[picks]
                routed = routed.to(out.dtype).index_add_(0, rows, out)
            start += count
        return routed.view(x.shape) + self.shared_experts(x)


def _per_row(lora: LoraRows | None) -> TypeGuard[LoraRows]:
    """Whether `lora` assigns adapters to some rows of a batch (not to every row of any batch)."""
    return lora is not None and lora.active and lora.num_rows is not None


def feed_forward(config: HiDreamImageTransformerConfig) -> nn.Module:
    """The image stream's feed-forward: experts when the config routes any, a plain SwiGLU otherwise."""
    dim = config.inner_dim
    if config.num_routed_experts > 0:
        return MoEFeedForward(dim, 4 * dim, config.num_routed_experts, config.num_activated_experts)
    return SwiGLU(dim, 4 * dim)


@dataclass(frozen=True)
class Positions:
    """What every attention of one forward shares: the RoPE tables over all its tokens, whether they
    cover a whole head or its first half, and the (batch, image tokens) 0/1 key mask of a padded grid."""

    rope: RopeTables
    half_head: bool
    image_mask: torch.Tensor | None


class HiDreamAttention(ReusableAttention):
    """Self-attention (single stream) or joint image/text attention (double stream, the text with its
    own `_t` projections), Diffusers' `HiDreamAttention` weights."""

    def __init__(self, dim: int, heads: int, head_dim: int, single: bool) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.single = single
        self.rotary = RotaryEmbedding()
        self.to_q, self.to_k = nn.Linear(dim, inner), nn.Linear(inner, inner)
        self.to_v, self.to_out = nn.Linear(inner, inner), nn.Linear(inner, dim)
        self.q_rms_norm = RMSNorm(inner, QK_EPS, round_once=True)
        self.k_rms_norm = RMSNorm(inner, QK_EPS, round_once=True)
        if not single:
            self.to_q_t, self.to_k_t = nn.Linear(dim, inner), nn.Linear(inner, inner)
            self.to_v_t, self.to_out_t = nn.Linear(inner, inner), nn.Linear(inner, dim)
            self.q_rms_norm_t = RMSNorm(inner, QK_EPS, round_once=True)
            self.k_rms_norm_t = RMSNorm(inner, QK_EPS, round_once=True)

    def _qkv(self, x: torch.Tensor, suffix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.heads
        q = getattr(self, "q_rms_norm" + suffix)(getattr(self, "to_q" + suffix)(x)).unflatten(2, (h, -1))
        k = getattr(self, "k_rms_norm" + suffix)(getattr(self, "to_k" + suffix)(x)).unflatten(2, (h, -1))
        v = getattr(self, "to_v" + suffix)(x).unflatten(2, (h, -1))
        return q, k, v

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not positions.half_head:
            return self.rotary(q, k, *positions.rope)
        q1, q2 = q.chunk(2, dim=-1)
        k1, k2 = k.chunk(2, dim=-1)
        q1, k1 = self.rotary(q1, k1, *positions.rope)
        return torch.cat([q1, q2], dim=-1), torch.cat([k1, k2], dim=-1)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | None, text: torch.Tensor | None, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`x` (batch, n, dim), `key_mask` (batch, n) or None, `text` (batch, m, dim) for a double-stream
        attention -> (x's output, text's output or None)."""
        q, k, v = self._qkv(x, "")
        if key_mask is not None:
            k = k * key_mask[:, :, None, None]
        n = x.shape[1]
        if text is not None:
            tq, tk, tv = self._qkv(text, "_t")
            q, k, v = torch.cat([q, tq], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1)
        q, k = self._rotate(q, k, positions)
        out = sequence_attention(q, k, v).flatten(2, 3)
        if text is None:
            return self.to_out(out), None
        return self.to_out(out[:, :n]), self.to_out_t(out[:, n:])


def modulate(x: torch.Tensor, norm: nn.Module, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return norm(x) * (1 + scale) + shift


class DoubleStreamBlock(nn.Module):
    """Image and text streams with joint attention (Diffusers' `HiDreamImageTransformerBlock`)."""

    def __init__(self, config: HiDreamImageTransformerConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 12 * dim))
        self.norm1_i = LayerNorm(dim, BLOCK_EPS, elementwise_affine=False)
        self.norm1_t = LayerNorm(dim, BLOCK_EPS, elementwise_affine=False)
        self.attn1 = HiDreamAttention(
            dim, config.num_attention_heads, config.attention_head_dim, single=False
        )
        self.norm3_i = LayerNorm(dim, BLOCK_EPS, elementwise_affine=False)
        self.ff_i = feed_forward(config)
        self.norm3_t = LayerNorm(dim, BLOCK_EPS, elementwise_affine=False)
        self.ff_t = SwiGLU(dim, 4 * dim)

    def forward(
        self, x: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (shift_i, scale_i, gate_i, mlp_shift_i, mlp_scale_i, mlp_gate_i,
         shift_t, scale_t, gate_t, mlp_shift_t, mlp_scale_t, mlp_gate_t) = (
            self.adaLN_modulation(temb)[:, None].chunk(12, dim=-1)
        )  # fmt: skip
        attn_i, attn_t = self.attn1(
            modulate(x, self.norm1_i, shift_i, scale_i),
            positions.image_mask,
            modulate(text, self.norm1_t, shift_t, scale_t),
            positions,
        )
        x = gate_i * attn_i + x
        text = gate_t * attn_t + text
        ff_i = self.ff_i(modulate(x, self.norm3_i, mlp_shift_i, mlp_scale_i))
        ff_t = self.ff_t(modulate(text, self.norm3_t, mlp_shift_t, mlp_scale_t))
        return mlp_gate_i * ff_i + x, mlp_gate_t * ff_t + text


class SingleStreamBlock(nn.Module):
    """One stream over image and text tokens (Diffusers' `HiDreamImageSingleTransformerBlock`)."""

    def __init__(self, config: HiDreamImageTransformerConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.norm1_i = LayerNorm(dim, BLOCK_EPS, elementwise_affine=False)
        self.attn1 = HiDreamAttention(dim, config.num_attention_heads, config.attention_head_dim, single=True)
        self.norm3_i = LayerNorm(dim, BLOCK_EPS, elementwise_affine=False)
        self.ff_i = feed_forward(config)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | None, temb: torch.Tensor, positions: Positions
    ) -> torch.Tensor:
        shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = self.adaLN_modulation(temb)[:, None].chunk(
            6, dim=-1
        )
        attn, _ = self.attn1(modulate(x, self.norm1_i, shift, scale), key_mask, None, positions)
        x = gate * attn + x
        return mlp_gate * self.ff_i(modulate(x, self.norm3_i, mlp_shift, mlp_scale)) + x


class BlockWrapper(nn.Module):
    """Diffusers' `HiDreamBlock`: holds the block as `.block` (its state-dict prefix)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block


class TimestepEmbed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIME_FREQUENCIES, dim)

    def forward(self, timesteps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_sinusoids(timesteps, TIME_FREQUENCIES).to(dtype))


class PooledEmbed(nn.Module):
    def __init__(self, text_emb_dim: int, dim: int) -> None:
        super().__init__()
        self.pooled_embedder = TimestepEmbedding(text_emb_dim, dim)


class PatchEmbed(nn.Module):
    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, dim)


class OutEmbed(nn.Module):
    """LayerNorm modulated by (shift, scale) from temb, then the patch projection."""

    def __init__(self, dim: int, out_features: int) -> None:
        super().__init__()
        self.norm_final = LayerNorm(dim, BLOCK_EPS, elementwise_affine=False)
        self.linear = nn.Linear(dim, out_features)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(temb).chunk(2, dim=1)
        return self.linear(modulate(x, self.norm_final, shift[:, None], scale[:, None]))


class CaptionProjection(nn.Module):
    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, dim, bias=False)


def image_positions(grid: tuple[int, int], padded_to: int | None, text_tokens: int, device) -> torch.Tensor:
    """(tokens, 3) ids: (0, row, col) per patch, zeros for the grid's padding (up to `padded_to`) and for
    the `text_tokens` after it."""
    rows, cols = grid
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    ids = torch.stack([torch.zeros_like(r), r, c], dim=-1).float()
    tail = (padded_to or rows * cols) - rows * cols + text_tokens
    return torch.cat([ids, ids.new_zeros(tail, 3)])


def single_key_mask(image_mask: torch.Tensor | None, joint_len: int, llama_len: int) -> torch.Tensor | None:
    """The single-stream blocks' (batch, image + text + Llama tokens) key mask: a padded grid's image mask,
    then ones for the text and the block's Llama tokens; None for an unpadded grid."""
    if image_mask is None:
        return None
    image_len = image_mask.shape[1]
    return torch.cat(
        [image_mask, image_mask.new_ones(image_mask.shape[0], joint_len - image_len + llama_len)], 1
    )


@dataclass(frozen=True)
class BlockInputs:
    """What every block of one forward reads besides its streams, for some batch rows: the timestep
    embedding, each block's Llama tokens and the positions (with the rows' image mask)."""

    temb: torch.Tensor
    llama: Sequence[torch.Tensor]
    positions: Positions

    def take(self, rows: torch.Tensor | None) -> BlockInputs:
        """These inputs for batch rows `rows` (None: all)."""
        if rows is None:
            return self
        mask = self.positions.image_mask
        positions = dataclasses.replace(
            self.positions, image_mask=None if mask is None else take_rows(mask, rows)
        )
        return BlockInputs(take_rows(self.temb, rows), [take_rows(t, rows) for t in self.llama], positions)


class HiDreamBlockRange:
    """HiDream's blocks as one sequence runnable in ranges (`cache_methods.blocks.BlockRange`): the
    double-stream blocks on the image and text streams, then the single-stream blocks on the joint
    [image ; text] sequence, which a range joins at its start and splits at its end (copies, no arithmetic).
    Running `[0, a)`, `[a, b)`, ... gives each row the values of `_run_blocks`."""

    def __init__(
        self,
        double_blocks: Sequence[nn.Module],
        single_blocks: Sequence[nn.Module],
        x: torch.Tensor,
        text: torch.Tensor,
        inputs: BlockInputs,
    ) -> None:
        self.double_blocks, self.single_blocks = list(double_blocks), list(single_blocks)
        self.x, self.text, self.inputs = x, text, inputs

    @property
    def num_blocks(self) -> int:
        return len(self.double_blocks) + len(self.single_blocks)

    def start(self) -> Streams:
        return Streams(self.x, self.text)

    def run(self, streams: Streams, rows: torch.Tensor | None, start: int, stop: int) -> Streams:
        x, text = streams.image, streams.text
        if text is None:
            raise RuntimeError("HiDream's blocks need the text stream")
        inputs = self.inputs.take(rows)
        n_double, text_len = len(self.double_blocks), text.shape[1]
        for i in range(start, min(stop, n_double)):
            block = self.double_blocks[i].block
            x, text = block(x, torch.cat([text, inputs.llama[i]], dim=1), inputs.temb, inputs.positions)
            text = text[:, :text_len]
        if stop <= n_double:
            return Streams(x, text)
        image_len = x.shape[1]
        h = torch.cat([x, text], dim=1)
        joint_len = h.shape[1]
        key_mask = single_key_mask(inputs.positions.image_mask, joint_len, inputs.llama[0].shape[1])
        for i in range(max(start, n_double), stop):
            block = self.single_blocks[i - n_double].block
            h = block(torch.cat([h, inputs.llama[i]], dim=1), key_mask, inputs.temb, inputs.positions)
            h = h[:, :joint_len]
        return Streams(h[:, :image_len], h[:, image_len:])


class HiDreamImageTransformer2DModel(DiffusersDiT):
    diffusers_class_name: ClassVar[str] = "HiDreamImageTransformer2DModel"
    config_class = HiDreamImageTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("double_stream_blocks", "single_stream_blocks")

    def __init__(self, config: HiDreamImageTransformerConfig) -> None:
        config.check()
        super().__init__(config)
        dim, p = config.inner_dim, config.patch_size
        assert p is not None and config.caption_channels is not None
        self.t_embedder = TimestepEmbed(dim)
        self.p_embedder = PooledEmbed(config.text_emb_dim, dim)
        self.x_embedder = PatchEmbed(config.in_channels * p * p, dim)
        self.double_stream_blocks = nn.ModuleList(
            [BlockWrapper(DoubleStreamBlock(config)) for _ in range(config.num_layers)]
        )
        self.single_stream_blocks = nn.ModuleList(
            [BlockWrapper(SingleStreamBlock(config)) for _ in range(config.num_single_layers)]
        )
        self.final_layer = OutEmbed(dim, p * p * config.out_channels)
        t5_width, llama_width = config.caption_channels
        blocks = config.num_layers + config.num_single_layers
        self.caption_projection = nn.ModuleList(
            [CaptionProjection(llama_width, dim) for _ in range(blocks)] + [CaptionProjection(t5_width, dim)]
        )
        self.max_seq = config.max_seq
        self._rope: BoundedCache[RopeTables] = BoundedCache(ROPE_CACHE_SIZE)

    def patchify(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(batch, C, H, W) -> (batch, tokens, p*p*C) patches (row-major, each (p_row, p_col, C)) and, for
        a non-square grid, the patches padded with zeros to `max_seq` and their (batch, max_seq) mask."""
        b, c, h, w = latents.shape
        p = self.config.patch_size
        rows, cols = h // p, w // p
        tokens = latents.reshape(b, c, rows, p, cols, p).permute(0, 2, 4, 3, 5, 1).reshape(b, rows * cols, -1)
        if h == w:
            return tokens, None
        if rows * cols > self.max_seq:
            raise ValueError(
                f"HiDream DiT: a {h}x{w} latent grid has {rows * cols} patches, more than max_resolution's {self.max_seq}"
            )
        padded = tokens.new_zeros(b, self.max_seq, tokens.shape[2])
        padded[:, : rows * cols] = tokens
        mask = tokens.new_zeros(b, self.max_seq)
        mask[:, : rows * cols] = 1.0
        return padded, mask

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        rows, cols = grid
        p = self.config.patch_size
        b = x.shape[0]
        x = x[:, : rows * cols].reshape(b, rows, cols, p, p, -1).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, -1, rows * p, cols * p)

    def positions(
        self, grid: tuple[int, int], padded: bool, text_tokens: int, image_mask: torch.Tensor | None, device
    ) -> Positions:
        axes = self.config.axes_dims_rope
        padded_to = self.max_seq if padded else None
        rope = self._rope.get_or_build(
            (grid, padded_to, text_tokens),
            device,
            lambda: multi_axis_rope_tables(
                image_positions(grid, padded_to, text_tokens, device), axes, ROPE_THETA
            ),
        )
        return Positions(rope, sum(axes) != self.config.attention_head_dim, image_mask)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timesteps: torch.Tensor,
        encoder_hidden_states_t5: torch.Tensor,
        encoder_hidden_states_llama3: torch.Tensor,
        pooled_embeds: torch.Tensor,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """(batch, C, H, W) latents, (batch,) timesteps, (batch, L5, t5 width) T5 states, (Llama layers,
        batch, Ll, Llama width) Llama hidden states (every layer, as the pipeline stacks them) and
        (batch, text_emb_dim) pooled CLIP embeddings -> (batch, out_channels, H, W). `step_cache`: rows of
        requests with a cache method, which may reuse the blocks' residual from an earlier step
        (`models/step_cache.py`); None runs every block for every row (exact)."""
        config = self.config
        _, _, h, w = hidden_states.shape
        p = config.patch_size
        grid = (h // p, w // p)
        tokens, image_mask = self.patchify(hidden_states)
        x = self.x_embedder.proj(tokens)
        temb = self.t_embedder(timesteps, hidden_states.dtype) + self.p_embedder.pooled_embedder(
            pooled_embeds
        )
        llama = [
            self.caption_projection[i].linear(encoder_hidden_states_llama3[layer])
            for i, layer in enumerate(config.llama_layers)
        ]
        t5 = self.caption_projection[-1].linear(encoder_hidden_states_t5)
        text = torch.cat([t5, llama[-1]], dim=1)
        text_len = text.shape[1]
        positions = self.positions(
            grid, image_mask is not None, text_len + llama[0].shape[1], image_mask, x.device
        )
        inputs = BlockInputs(temb, llama, positions)
        signal = partial(self._cache_signal, x, temb)
        x = run_streams_with_step_cache(step_cache, x, text, inputs, signal, self._blocks, self._block_range)
        return self.unpatchify(self.final_layer(x, temb), grid)

    def _blocks(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every block over these rows, on one device or over the sequence-parallel ranks."""
        split = sequence_split([x.shape[1], text.shape[1], inputs.llama[0].shape[1]])
        if split is None:
            return self._run_blocks(x, text, inputs)
        return self._run_blocks_split(split, x, text, inputs)

    def _block_range(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> HiDreamBlockRange:
        """The blocks as a `BlockRange` for DBCache (refused under sequence parallelism)."""
        refuse_sequence_parallel(
            sequence_split([x.shape[1], text.shape[1], inputs.llama[0].shape[1]]), "HiDream-I1"
        )
        return HiDreamBlockRange(self.double_stream_blocks, self.single_stream_blocks, x, text, inputs)

    def _cache_signal(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The first block's timestep-modulated image input: what the step cache watches change."""
        block = (self.double_stream_blocks or self.single_stream_blocks)[0].block
        chunks = 12 if isinstance(block, DoubleStreamBlock) else 6
        shift, scale = block.adaLN_modulation(temb)[:, None].chunk(chunks, dim=-1)[:2]
        return modulate(x, block.norm1_i, shift, scale)

    def _run_blocks(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every double- then single-stream block over the image tokens `x`, the text stream and each
        block's Llama tokens; returns the image tokens the output head reads."""
        config = self.config
        temb, llama, positions = inputs.temb, inputs.llama, inputs.positions
        image_mask = positions.image_mask
        text_len = text.shape[1]
        for i, wrapper in enumerate(self.double_stream_blocks):
            x, text = wrapper.block(x, torch.cat([text, llama[i]], dim=1), temb, positions)
            text = text[:, :text_len]
        image_len = x.shape[1]
        x = torch.cat([x, text], dim=1)
        joint_len = x.shape[1]
        key_mask = single_key_mask(image_mask, joint_len, llama[0].shape[1])
        for j, wrapper in enumerate(self.single_stream_blocks):
            x = wrapper.block(torch.cat([x, llama[config.num_layers + j]], dim=1), key_mask, temb, positions)
            x = x[:, :joint_len]
        return x[:, :image_len]

    def _run_blocks_split(
        self, split: SequenceSplit, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs
    ) -> torch.Tensor:
        """`_run_blocks` with the image (stream 0), text (1) and Llama (2) tokens split over the
        sequence-parallel ranks (module docstring): the blocks run on this rank's shards in the joint order,
        the RoPE tables and the padded grid's key mask are cut like the tokens, and the image tokens are
        gathered back at the end."""
        image, text_stream, llama_stream = 0, 1, 2
        positions = inputs.positions
        image_mask = positions.image_mask
        local_mask = None if image_mask is None else split.split(image, image_mask)
        local = Positions(split.split_rope(positions.rope), positions.half_head, local_mask)
        x, text = split.split(image, x), split.split(text_stream, text)
        llama = [split.split(llama_stream, states) for states in inputs.llama]
        with split.attention_scope(x.shape[0], x.device):
            x = self._run_blocks(x, text, BlockInputs(inputs.temb, llama, local))
        return split.gather(image, x)
