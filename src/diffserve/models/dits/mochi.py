"""Mochi 1 transformer (Genmo), native, loading Diffusers `MochiTransformer3DModel` weights unchanged.

    temb = MLP(sinusoids(t)) + attention-pool(T5 states, mask)                  (batch, inner)
    text = caption_proj(T5 states)                                              (batch, L, pooled_dim)
    x    = patchify(latents): a 2-D conv per frame, p x p patches               (batch, F*H*W, inner)
    num_layers x asymmetric block (video width inner, text width pooled_dim):
        both streams: RMSNorm(.) * (1 + scale) from Linear(SiLU(temb))
        joint attention: q/k RMSNorm per head, 3-D RoPE (learned frequencies) on the video q and k, the
                         text's padding tokens left out of the keys (and their outputs zero, as Diffusers
                         computes each sample over its valid tokens only)
        x += RMSNorm(attn) * tanh(gate); x += RMSNorm(SwiGLU(RMSNorm(x) * (1 + scale))) * tanh(gate)
        the last block updates the video stream only (its text is only attended)
    out  = proj_out(adaLN(LayerNorm(x), temb)) unpatchified to (batch, channels, frames, height, width)

Inputs and outputs are in Diffusers' layout (batch, channels, frames, height, width). Timesteps are embedded
per sample, so requests at different steps share one forward; each sample has its own text mask.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): the video and the text tokens
are two streams, each split over the sequence-parallel ranks (the RoPE rows with the video tokens); every
block's joint attention runs once over the local [video; text] shards with `sequence_attention`, the text
mask and the shards' padding masked as keys. That equals the one-device forward's per-length groups for
the video: a padded text token is a key in no group, and what it computes as a query (zero on one device,
an attention output here) reaches only its own padded position, which no key, no valid token and not the
output ever read. A text mask that is not a prefix of valid tokens (T5's padding always is) cannot be
split: the one-device forward adds each sample's valid tokens' outputs to the leading text positions
(Diffusers' valid-first packing), a permutation across the text shards; it is refused (ValueError). With
one sequence-parallel rank nothing changes.

Cache methods (`models/step_cache.py`, issue 33): the cached span is every block, from the patch tokens to
the video tokens `norm_out` reads; the watched signal is the first block's modulated video input. DBCache
counts the blocks as cache-dit's Mochi adapter does and runs them in ranges on (video, text) streams (the
text layout found again for the rows a range runs); it is refused under a sequence split
(`refuse_sequence_parallel`), the whole-span methods run there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.adaln import AdaLayerNormContinuous
from diffserve.layers.attention import attention
from diffserve.layers.attention_reuse import ReusableAttention
from diffserve.layers.embeddings import TimestepEmbedding, timestep_sinusoids
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.block_inputs import run_streams_with_step_cache
from diffserve.models.step_cache import BatchStepCache, take_rows

#: Diffusers' eps of the modulated RMSNorms and of the per-head q/k norms.
BLOCK_EPS = 1e-6
QK_EPS = 1e-5
#: Heads of the text attention pool (fixed in Diffusers).
POOL_HEADS = 8
#: RoPE spreads rows and columns as if the grid covered this many (192 x 192) patches.
ROPE_BASE_AREA = 192 * 192
ROPE_CACHE_SIZE = 8


@dataclass(frozen=True)
class MochiTransformerConfig(DiTConfig):
    """The Mochi DiT's Diffusers config (`transformer/config.json`), one field per key, Diffusers' defaults."""

    patch_size: int = 2
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 48
    pooled_projection_dim: int = 1536
    in_channels: int = 12
    out_channels: int | None = None
    qk_norm: str = "rms_norm"
    text_embed_dim: int = 4096
    time_embed_dim: int = 256
    activation_fn: str = "swiglu"
    max_sequence_length: int = 256

    def __post_init__(self) -> None:
        name = "MochiTransformer3DModel"
        if self.qk_norm != "rms_norm":
            raise ValueError(f"{name}: qk_norm must be rms_norm, got {self.qk_norm!r}")
        if self.activation_fn != "swiglu":
            raise ValueError(f"{name}: activation_fn must be swiglu, got {self.activation_fn!r}")
        if self.out_channels is None:
            self._normalise(out_channels=self.in_channels)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def modulated_rms(x: torch.Tensor, scale: torch.Tensor, eps: float = BLOCK_EPS) -> torch.Tensor:
    """RMSNorm(x) * scale computed in float32, back in x's dtype (Diffusers' `MochiModulatedRMSNorm`)."""
    return (rms(x, eps) * scale.float()).to(x.dtype)


class HeadRMSNorm(nn.Module):
    """Per-head RMSNorm with a weight (Diffusers' `MochiRMSNorm`): normalised in float32, weighted, cast back."""

    def __init__(self, dim: int, eps: float = QK_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps) * self.weight).to(x.dtype)


class SwiGLU(nn.Module):
    """Diffusers' `FeedForward(activation_fn="swiglu", bias=False)`: `net.0.proj` -> (hidden, gate), `net.2`."""

    class _Proj(nn.Module):
        def __init__(self, dim: int, inner: int) -> None:
            super().__init__()
            self.proj = nn.Linear(dim, 2 * inner, bias=False)

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([self._Proj(dim, inner), nn.Identity(), nn.Linear(inner, dim, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.net[0].proj(x).chunk(2, dim=-1)
        return self.net[2](hidden * F.silu(gate))


class RMSNormZero(nn.Module):
    """(scale_msa, gate_msa, scale_mlp, gate_mlp) from Linear(SiLU(temb)); returns the modulated input too."""

    def __init__(self, embedding_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(embedding_dim, hidden_dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.linear(F.silu(temb)).chunk(4, dim=1)
        normed = modulated_rms(x, 1 + scale_msa[:, None].float())
        return normed, gate_msa, scale_mlp, gate_mlp


class ContextNormOut(nn.Module):
    """The last block's text norm: RMSNorm(text) * (1 + Linear(SiLU(temb))) (Diffusers' `MochiLayerNormContinuous`)."""

    def __init__(self, embedding_dim: int, conditioning_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(conditioning_dim, embedding_dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear_1(F.silu(temb).to(x.dtype))
        return modulated_rms(x, 1 + scale[:, None].float())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of (batch, tokens, heads, head_dim) by (tokens, heads, head_dim / 2) tables."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack([(even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype)], dim=-1)
    return out.flatten(-2)


class MochiAttention(ReusableAttention):
    """Joint attention of the video tokens and the valid text tokens, Diffusers' `MochiAttention` weights."""

    def __init__(self, dim: int, text_dim: int, heads: int, head_dim: int, context_pre_only: bool) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.context_pre_only = context_pre_only
        self.norm_q, self.norm_k = HeadRMSNorm(head_dim), HeadRMSNorm(head_dim)
        self.norm_added_q, self.norm_added_k = HeadRMSNorm(head_dim), HeadRMSNorm(head_dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.add_k_proj = nn.Linear(text_dim, inner, bias=False)
        self.add_v_proj = nn.Linear(text_dim, inner, bias=False)
        self.add_q_proj = nn.Linear(text_dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])
        if not context_pre_only:
            self.to_add_out = nn.Linear(inner, text_dim)

    def forward(
        self,
        x: torch.Tensor,
        text: torch.Tensor,
        layout: TextLayout,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.heads
        q = _rotate(self.norm_q(self.to_q(x).unflatten(2, (h, -1))), *rope)
        k = _rotate(self.norm_k(self.to_k(x).unflatten(2, (h, -1))), *rope)
        v = self.to_v(x).unflatten(2, (h, -1))
        tq = layout.valid_first(self.norm_added_q(self.add_q_proj(text).unflatten(2, (h, -1))))
        tk = layout.valid_first(self.norm_added_k(self.add_k_proj(text).unflatten(2, (h, -1))))
        tv = layout.valid_first(self.add_v_proj(text).unflatten(2, (h, -1)))
        n, total = x.shape[1], x.shape[1] + text.shape[1]
        if len(layout.groups) == 1 and layout.groups[0][0] == text.shape[1]:
            # Every text token at once: also the sequence-split case (`TextLayout.whole`), where the scope
            # masks the padded text keys and `sequence_attention` reaches every rank's tokens.
            out = sequence_attention(torch.cat([q, tq], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1))
        else:
            # Each group of rows with the same number of valid text tokens attends over the video and those
            # tokens only (Diffusers runs each sample so); the text rows past them stay zero.
            out = q.new_zeros(q.shape[0], total, *q.shape[2:])
            for length, rows in layout.groups:
                piece = attention(
                    torch.cat([q[rows], tq[rows, :length]], 1),
                    torch.cat([k[rows], tk[rows, :length]], 1),
                    torch.cat([v[rows], tv[rows, :length]], 1),
                )
                out[rows, : n + length] = piece
        out = out.flatten(2, 3)
        # Both projections run on views of the whole (batch, tokens, inner) output, as Diffusers' do (a
        # contiguous copy rounds differently in half precision).
        video = self.to_out[0](out[:, :n])
        if self.context_pre_only:
            return video, None
        return video, self.to_add_out(out[:, n:])


@dataclass(frozen=True)
class TextLayout:
    """Where each sample's valid text tokens are, found once per forward (one host read of the mask).

    `order`: per sample, the token indices with the valid ones first (stably), or None when every mask is a
    prefix (T5's padding always is); `groups`: (valid length, row indices) for each length present."""

    order: torch.Tensor | None
    groups: tuple[tuple[int, torch.Tensor], ...]

    @classmethod
    def of(cls, mask: torch.Tensor) -> TextLayout:
        lengths = mask.sum(dim=1)
        prefix = torch.arange(mask.shape[1], device=mask.device)[None] < lengths[:, None]
        facts = torch.stack([lengths, (mask == prefix).all(dim=1).to(lengths.dtype)]).tolist()
        order = None
        if not all(facts[1]):
            order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
        by_length: dict[int, list[int]] = {}
        for row, length in enumerate(facts[0]):
            by_length.setdefault(int(length), []).append(row)
        groups = tuple(
            (length, torch.tensor(rows, device=mask.device)) for length, rows in sorted(by_length.items())
        )
        return cls(order, groups)

    @classmethod
    def whole(cls, batch: int, length: int, device: torch.device) -> TextLayout:
        """Every one of `length` text tokens in every row, unordered: one attention over them all."""
        return cls(None, ((length, torch.arange(batch, device=device)),))

    def valid_first(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, L, ...) text tokens with each sample's valid ones moved to the front."""
        if self.order is None:
            return tokens
        index = self.order.view(*self.order.shape, *([1] * (tokens.dim() - 2))).expand_as(tokens)
        return tokens.gather(1, index)


class MochiBlock(nn.Module):
    def __init__(self, config: MochiTransformerConfig, last: bool) -> None:
        super().__init__()
        dim, text_dim = config.inner_dim, config.pooled_projection_dim
        self.context_pre_only = last
        self.norm1 = RMSNormZero(dim, 4 * dim)
        self.norm1_context: nn.Module = (
            ContextNormOut(text_dim, dim) if last else RMSNormZero(dim, 4 * text_dim)
        )
        self.attn1 = MochiAttention(
            dim, text_dim, config.num_attention_heads, config.attention_head_dim, last
        )
        self.ff = SwiGLU(dim, (4 * dim * 2) // 3)
        self.ff_context = None if last else SwiGLU(text_dim, (4 * text_dim * 2) // 3)

    def forward(
        self,
        x: torch.Tensor,
        text: torch.Tensor,
        temb: torch.Tensor,
        layout: TextLayout,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, gate_msa, scale_mlp, gate_mlp = self.norm1(x, temb)
        if self.context_pre_only:
            normed_text = self.norm1_context(text, temb)
        else:
            normed_text, t_gate_msa, t_scale_mlp, t_gate_mlp = self.norm1_context(text, temb)
        attn, text_attn = self.attn1(normed, normed_text, layout, rope)
        x = x + modulated_rms(attn, torch.tanh(gate_msa)[:, None])
        ff = self.ff(modulated_rms(x, 1 + scale_mlp[:, None].float()))
        x = x + modulated_rms(ff, torch.tanh(gate_mlp)[:, None])
        if not self.context_pre_only:
            text = text + modulated_rms(text_attn, torch.tanh(t_gate_msa)[:, None])
            ff = self.ff_context(modulated_rms(text, 1 + t_scale_mlp[:, None].float()))
            text = text + modulated_rms(ff, torch.tanh(t_gate_mlp)[:, None])
        return x, text


class AttentionPool(nn.Module):
    """The text's pooled vector: the masked mean token attends over [mean; tokens] (Diffusers' `MochiAttentionPool`)."""

    def __init__(self, embed_dim: int, output_dim: int) -> None:
        super().__init__()
        self.to_kv = nn.Linear(embed_dim, 2 * embed_dim)
        self.to_q = nn.Linear(embed_dim, embed_dim)
        self.to_out = nn.Linear(embed_dim, output_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        weights = mask[:, :, None].to(x.dtype)
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1)
        mean = (x * weights).sum(dim=1, keepdim=True)
        x = torch.cat([mean, x], dim=1)
        k, v = self.to_kv(x).unflatten(2, (2, POOL_HEADS, d // POOL_HEADS)).unbind(2)
        # The query from the (batch, dim) mean row, as Diffusers shapes it (a 3-D input rounds differently).
        q = self.to_q(x[:, 0]).unflatten(1, (POOL_HEADS, d // POOL_HEADS))[:, None]
        keep = F.pad(mask.bool(), (1, 0), value=True)
        out = attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.to_out(out.reshape(b, d))


class TimeCaptionEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)) + pool(text); text projected to the text stream's width."""

    def __init__(self, config: MochiTransformerConfig) -> None:
        super().__init__()
        inner = config.inner_dim
        self.time_embed_dim = config.time_embed_dim
        self.timestep_embedder = TimestepEmbedding(config.time_embed_dim, inner)
        self.pooler = AttentionPool(config.text_embed_dim, inner)
        self.caption_proj = nn.Linear(config.text_embed_dim, config.pooled_projection_dim)

    def forward(
        self, timestep: torch.Tensor, text: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.timestep_embedder(timestep_sinusoids(timestep, self.time_embed_dim).to(dtype))
        return emb + self.pooler(text, mask), self.caption_proj(text)


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, dim: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch, stride=patch)


def rope_positions(frames: int, height: int, width: int, device) -> torch.Tensor:
    """(frames * height * width, 3) float32 (frame, row, column) positions: frames 0, 1, ...; rows and columns
    the centres of equal cells over a grid rescaled to 192 x 192 patches' area, centred on zero."""
    scale = (ROPE_BASE_AREA / (height * width)) ** 0.5

    def centres(n: int) -> torch.Tensor:
        edges = torch.linspace(-n * scale / 2, n * scale / 2, n + 1, device=device, dtype=torch.float32)
        return (edges[:-1] + edges[1:]) / 2

    t = torch.arange(frames, device=device, dtype=torch.float32)
    grid = torch.meshgrid(t, centres(height), centres(width), indexing="ij")
    return torch.stack(grid, dim=-1).view(-1, 3)


class BlockInputs(NamedTuple):
    """What the blocks read besides the video and text streams, per forward: the timestep embedding, the
    text layout and mask of these rows, and the RoPE tables (shared by every row)."""

    temb: torch.Tensor
    layout: TextLayout
    mask: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]

    def take(self, rows: torch.Tensor | None) -> BlockInputs:
        """These inputs for batch rows `rows` (None: all); a subset finds its text layout again (one host
        read of its mask)."""
        if rows is None:
            return self
        mask = take_rows(self.mask, rows)
        return BlockInputs(take_rows(self.temb, rows), TextLayout.of(mask), mask, self.rope)


class MochiTransformer3DModel(DiffusersDiT):
    diffusers_class_name: ClassVar[str] = "MochiTransformer3DModel"
    config_class = MochiTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: MochiTransformerConfig) -> None:
        super().__init__(config)
        inner, p = config.inner_dim, config.patch_size
        self.patch_embed = PatchEmbed(config.in_channels, inner, p)
        self.time_embed = TimeCaptionEmbedding(config)
        self.pos_frequencies = nn.Parameter(
            torch.zeros(3, config.num_attention_heads, config.attention_head_dim // 2)
        )
        self.transformer_blocks = nn.ModuleList(
            [MochiBlock(config, i == config.num_layers - 1) for i in range(config.num_layers)]
        )
        self.norm_out = AdaLayerNormContinuous(inner)
        self.proj_out = nn.Linear(inner, p * p * config.out_channels)
        self._positions: BoundedCache[torch.Tensor] = BoundedCache(ROPE_CACHE_SIZE)

    def rope(self, frames: int, height: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self._positions.get_or_build(
            (frames, height, width), device, lambda: rope_positions(frames, height, width, device)
        )
        freqs = torch.einsum("nd,dhf->nhf", pos, self.pos_frequencies.float())
        return freqs.cos(), freqs.sin()

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """(batch, channels, frames, H, W) latents, (batch, L, text_embed_dim) T5 states, their (batch, L) mask
        and (batch,) timesteps -> (batch, out_channels, frames, H, W). `step_cache`: rows of requests with
        a cache method, which may reuse the blocks' residual from an earlier step; None runs every block."""
        b, c, f, h, w = hidden_states.shape
        p = self.config.patch_size
        mask = encoder_attention_mask.bool()
        temb, text = self.time_embed(timestep, encoder_hidden_states, mask, hidden_states.dtype)
        x = self.patch_embed.proj(hidden_states.transpose(1, 2).flatten(0, 1))
        x = x.flatten(2).transpose(1, 2).unflatten(0, (b, f)).flatten(1, 2)
        rope = self.rope(f, h // p, w // p, x.device)
        inputs = BlockInputs(temb, TextLayout.of(mask), mask, rope)

        def signal() -> torch.Tensor:
            return self.transformer_blocks[0].norm1(x, temb)[0]

        x = run_streams_with_step_cache(step_cache, x, text, inputs, signal, self._blocks, self._block_range)
        x = self.proj_out(self.norm_out(x, F.silu(temb)))
        out = x.reshape(b, f, h // p, w // p, p, p, -1).permute(0, 6, 1, 2, 4, 3, 5)
        return out.reshape(b, -1, f, h, w)

    def _blocks(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every block over these rows (`inputs` theirs), on one device or over the sequence-parallel
        ranks."""
        split = sequence_split([x.shape[1], text.shape[1]])
        if split is None:
            return self._run_blocks(x, text, inputs)
        return self._run_blocks_split(split, x, text, inputs)

    def _block_range(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> SequentialBlocks:
        """The blocks as a `BlockRange` for DBCache: video and text streams (the last block leaves the text
        as it is). A range on some rows finds their text layout again (one host read of their mask)."""
        refuse_sequence_parallel(sequence_split([x.shape[1], text.shape[1]]), "Mochi")

        def call(i: int, x: torch.Tensor, text: torch.Tensor | None, rows: BlockInputs) -> tuple:
            return self.transformer_blocks[i](x, text, rows.temb, rows.layout, rows.rope)

        return SequentialBlocks(len(self.transformer_blocks), x, text, inputs.take, call)

    def _run_blocks(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every block over the video and text tokens; the video tokens the output head reads."""
        for block in self.transformer_blocks:
            x, text = block(x, text, inputs.temb, inputs.layout, inputs.rope)
        return x

    def _run_blocks_split(
        self, split: SequenceSplit, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs
    ) -> torch.Tensor:
        """`_run_blocks` with the video (stream 0) and text (stream 1) tokens split over the
        sequence-parallel ranks (module docstring): one attention per block over the local [video; text]
        shards, the text mask as the scope's key mask (None when every token is valid). The video tokens
        are gathered back at the end. ValueError for a text mask that is not a prefix of valid tokens."""
        if inputs.layout.order is not None:
            raise ValueError(
                "Mochi's sequence split (--ulysses-degree / --ring-degree) needs each sample's valid text "
                "tokens first (a prefix mask, as T5's padding): this mask has padding between valid tokens"
            )
        video, text_stream = 0, 1
        groups = inputs.layout.groups
        all_valid = len(groups) == 1 and groups[0][0] == text.shape[1]
        text_mask = None if all_valid else inputs.mask
        rope = (split.split(video, inputs.rope[0], dim=0), split.split(video, inputs.rope[1], dim=0))
        x, text = split.split(video, x), split.split(text_stream, text)
        whole = TextLayout.whole(x.shape[0], text.shape[1], x.device)
        with split.attention_scope(x.shape[0], x.device, [None, text_mask]):
            x = self._run_blocks(x, text, inputs._replace(layout=whole, rope=rope))
        return split.gather(video, x)
