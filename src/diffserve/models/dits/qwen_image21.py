"""Qwen-Image 2.1 transformer, native, loading Diffusers `QwenImage21Transformer2DModel` weights unchanged.

One single-stream sequence per sample: the prefix (the Qwen3-VL prompt states, with each condition
image's latent tokens in place of its vision slots: one slot stands for 2x2 latent tokens), then the
target image's latent tokens (unpatched: one token per latent pixel, 16x16 image pixels):

    text = txt_in(states): zero-centred RMSNorm, Linear, tanh-GELU, Linear              (B, L, inner)
    img  = img_in(latents)                                                              (B, N, inner)
    temb = MLP(sinusoids(1000 t)); with `causal_condition` one more row at t = 0        (B [+1], inner)
    mod  = Linear(SiLU(temb)), shared by every block: (scale1, gate1, scale2, gate2)
    num_layers x block (no per-block modulation weights):
        x += tanh(gate1) * attn(LayerNorm(x) * (1 + scale1))
        x += tanh(gate2) * SwiGLU(LayerNorm(x) * (1 + scale2))
    out  = proj_out(LayerNorm(img) * (1 + Linear(SiLU(temb))))                          (B, N, out_channels)

Attention is block-causal: prefix tokens see the prefix before them (causally), a condition image's
tokens also see their whole image; the target's tokens see all of the prefix and the whole target. With
`causal_condition` the prefix is modulated from t = 0 (its activations do not depend on the step); the
target from its own sample's timestep.

RoPE (3 axes: frame, height, width, each an interleaved-pair slice of the head): a running position
advances one per text token, which sits at (p, p, p); an image block (condition or target) sits at frame
p on a height/width grid centred on 0, and advances p by max(h, w).

Batching: each sample keeps its own prefix (text length, condition images). Prefixes are right-padded to
the longest in the batch; the padding is never a key and each sample's positions are its own, so a
sample's output is the one it gives alone (Diffusers' pipeline encodes one prompt per call and never
pads). In a batch whose rows apply LoRA adapters of their own, the prefix's t = 0 modulation row is
computed per row.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): the target's image tokens (with
their RoPE rows) are split over the sequence-parallel ranks and gathered before the output head. The
prefix is not split: its block-causal attention masks per query, which the split attention (per-key masks
only) cannot take, so every rank runs the prefix whole, as on one device (its cost does not shrink with
the degree). The target's attention reads the whole prefix: each rank passes its shard of the prefix's
q/k/v with its image shard to `sequence_attention` (the prefix's padding and the shards' padding masked
as keys) and keeps the image queries' output, so the keys are every prefix and every image token.
With one sequence-parallel rank nothing changes.

Step cache (`models/step_cache.py`, the cache methods by name): the whole-span methods reuse the residual
of every block; DBCache runs the blocks in ranges (`SequentialBlocks`) on the image and prefix streams,
both updated by every block. Block-range methods are refused under sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.attention import attention
from diffserve.layers.attention_reuse import ReusableAttention
from diffserve.layers.embeddings import timestep_sinusoids
from diffserve.layers.lora_rows import current_lora_rows
from diffserve.layers.norms import RMSNorm
from diffserve.layers.rotary import checked_rope_axes
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows

#: Sinusoid channels of the timestep embedding, and the factor the [0, 1] timestep is scaled by first.
TIMESTEP_CHANNELS = 256
TIME_FACTOR = 1000.0
ROPE_THETA = 10000


@dataclass(frozen=True)
class QwenImage21TransformerConfig(DiTConfig):
    """The Qwen-Image 2.1 DiT's Diffusers config (`transformer/config.json`), Diffusers' defaults."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True

    def __post_init__(self) -> None:
        if self.patch_size != 1:
            # Diffusers' pipeline packs latents as a plain flatten: only unpatched latents are served.
            raise ValueError(f"QwenImage21Transformer2DModel: patch_size must be 1, got {self.patch_size}")
        axes = checked_rope_axes("axes_dims_rope", self.axes_dims_rope, self.attention_head_dim, count=3)
        self._normalise(axes_dims_rope=axes, out_channels=self.out_channels or self.in_channels)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight is `scale - 1` (Diffusers' `QwenImage21ZeroCenterRMSNorm`), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.weight.float() + 1)).to(x.dtype)


class TextProjection(nn.Module):
    """Prompt states -> the DiT's width: norm, Linear, tanh-GELU, Linear (all bias-free)."""

    def __init__(self, in_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.text_norm = ZeroCenteredRMSNorm(in_dim, eps)
        self.in_layer = nn.Linear(in_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class TimestepMLP(nn.Module):
    """Diffusers' `TimestepEmbedding(256, dim, sample_proj_bias=False)`: Linear, SiLU, Linear, bias-free."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(TIMESTEP_CHANNELS, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeEmbedding(nn.Module):
    """(rows,) timesteps in [0, 1] -> (rows, dim): cosines then sines of 1000 t (float32), then the MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepMLP(dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scaled = TIME_FACTOR * timestep.float()
        features = timestep_sinusoids(scaled, TIMESTEP_CHANNELS).to(timestep.dtype)
        return self.timestep_embedder(features.to(dtype))


class SwiGLU(nn.Module):
    """out(SiLU(gate_layer(x)) * proj(x)), bias-free."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.out = nn.Linear(hidden, dim, bias=False)
        self.gate_layer = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.gate_layer(x)) * self.proj(x))


def rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """(B, S, heads, head_dim) rotated pairwise by complex `cis` (B or 1, S, head_dim / 2), in float32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * cis.unsqueeze(2)).flatten(3).type_as(x)


@dataclass(frozen=True)
class ConditionBlock:
    """One condition image of a sample: its packed latents (h * w, in_channels, row-major over `grid`
    (h, w)) take the place of the `slots` vision-slot states that start at text index `slot`."""

    slot: int
    slots: int
    latents: torch.Tensor
    grid: tuple[int, int]

    def __post_init__(self) -> None:
        h, w = self.grid
        if h * w != 4 * self.slots or self.latents.shape[0] != h * w:
            raise ValueError(
                f"condition image of grid {self.grid} ({self.latents.shape[0]} latent tokens) does not fill "
                f"{self.slots} vision slots of 2x2 latent tokens"
            )


@dataclass(frozen=True)
class Rope:
    """Complex RoPE factors: `text` (B, P, head_dim / 2) of the prefix, `image` (B, N, head_dim / 2)."""

    text: torch.Tensor
    image: torch.Tensor

    def take(self, rows: torch.Tensor | None) -> Rope:
        """These factors for batch rows `rows` (None: all)."""
        return Rope(take_rows(self.text, rows), take_rows(self.image, rows))


class Attention(ReusableAttention):
    """Block-causal attention with Diffusers' `QwenImage21Attention` weights (bias-free, q/k RMSNorm)."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False), nn.Identity()])
        self.norm_q = RMSNorm(head_dim, eps=eps)
        self.norm_k = RMSNorm(head_dim, eps=eps)

    def qkv(self, x: torch.Tensor, cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.to_q(x).unflatten(-1, (-1, self.head_dim))
        k = self.to_k(x).unflatten(-1, (-1, self.head_dim))
        v = self.to_v(x).unflatten(-1, (-1, self.head_dim))
        q = self.norm_q(q).to(v.dtype)
        k = self.norm_k(k).to(v.dtype)
        return rotate(q, cis), rotate(k, cis), v

    def forward(
        self,
        text: torch.Tensor,
        image: torch.Tensor,
        rope: Rope,
        masks: AttentionMasks,
        split: SequenceSplit | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(prefix output, image output). `split`: the [prefix, image] streams' split when `image` is this
        rank's shard (the prefix is whole; module docstring), inside its `attention_scope`."""
        tq, tk, tv = self.qkv(text, rope.text)
        iq, ik, iv = self.qkv(image, rope.image)
        text_out = attention(tq, tk, tv, attn_mask=masks.text)
        if split is None:
            image_out = attention(iq, torch.cat([tk, ik], 1), torch.cat([tv, iv], 1), attn_mask=masks.image)
        else:
            prefix = 0
            q, k, v = (torch.cat([split.split(prefix, t), i], 1) for t, i in ((tq, iq), (tk, ik), (tv, iv)))
            image_out = sequence_attention(q, k, v)[:, split.shards[prefix].shard_len :]
        project = self.to_out[0]
        return project(text_out.flatten(2).type_as(tq)), project(image_out.flatten(2).type_as(iq))


@dataclass(frozen=True)
class AttentionMasks:
    """`text`: (B, 1, P, P) block-causal over valid keys; `image`: (B, 1, 1, P + N) valid keys, or None
    (no padding)."""

    text: torch.Tensor
    image: torch.Tensor | None

    @classmethod
    def of(
        cls, lengths: list[int], block_ids: torch.Tensor, image_len: int, device: torch.device
    ) -> AttentionMasks:
        """`block_ids`: (B, P) the condition image each prefix token belongs to, -1 for text."""
        text_len = block_ids.shape[1]
        positions = torch.arange(text_len, device=device)
        valid = positions[None, :] < torch.tensor(lengths, device=device)[:, None]  # (B, P)
        causal = positions[None, :] <= positions[:, None]  # (P, P): key <= query
        same_image = (block_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, :, None] >= 0)
        text = ((causal[None] | same_image) & valid[:, None, :])[:, None]
        image = None
        if min(lengths) < text_len:
            keys = torch.cat([valid, valid.new_ones(len(lengths), image_len)], dim=1)
            image = keys[:, None, None, :]
        return cls(text, image)

    def take(self, rows: torch.Tensor | None) -> AttentionMasks:
        """These masks for batch rows `rows` (None: all)."""
        return AttentionMasks(
            take_rows(self.text, rows), None if self.image is None else take_rows(self.image, rows)
        )


class BlockInputs(NamedTuple):
    """What every block reads besides its two streams: the modulation rows of the text and of the image
    tokens, the RoPE factors and the attention masks."""

    text_mod: torch.Tensor
    image_mod: torch.Tensor
    rope: Rope
    masks: AttentionMasks

    def take(self, rows: torch.Tensor | None) -> BlockInputs:
        """These inputs for batch rows `rows` (None: all)."""
        return BlockInputs(
            take_rows(self.text_mod, rows),
            take_rows(self.image_mod, rows),
            self.rope.take(rows),
            self.masks.take(rows),
        )


class Block(nn.Module):
    """Single-stream block; its scales and gates come from the model's shared modulation."""

    def __init__(self, config: QwenImage21TransformerConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.eps = config.eps
        self.attn = Attention(dim, config.num_attention_heads, config.attention_head_dim, config.eps)
        self.img_mlp = SwiGLU(dim, dim * config.mlp_ratio)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps)

    def forward(
        self, text: torch.Tensor, image: torch.Tensor, inputs: BlockInputs, split: SequenceSplit | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`inputs.text_mod` / `inputs.image_mod`: (B or 1, 1, 4 * dim) modulation rows of the text / image
        tokens; `split`: `Attention.forward`'s."""
        t_scale1, t_gate1, t_scale2, t_gate2 = inputs.text_mod.chunk(4, dim=-1)
        i_scale1, i_gate1, i_scale2, i_gate2 = inputs.image_mod.chunk(4, dim=-1)
        text_attn, image_attn = self.attn(
            self.norm(text) * (1 + t_scale1),
            self.norm(image) * (1 + i_scale1),
            inputs.rope,
            inputs.masks,
            split,
        )
        text = text + t_gate1.tanh() * text_attn
        image = image + i_gate1.tanh() * image_attn
        text = text + t_gate2.tanh() * self.img_mlp(self.norm(text) * (1 + t_scale2))
        image = image + i_gate2.tanh() * self.img_mlp(self.norm(image) * (1 + i_scale2))
        if image.dtype == torch.float16:
            text, image = text.clip(-65504, 65504), image.clip(-65504, 65504)
        return text, image


class OutputNorm(nn.Module):
    """LayerNorm(x) * (1 + Linear(SiLU(temb))): scale only (Diffusers' `QwenImage21AdaLayerNormContinuous`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear(F.silu(temb).to(x.dtype))[:, None]
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps) * (1 + scale)


class QwenImage21Transformer2DModel(DiffusersDiT):
    diffusers_class_name: ClassVar[str] = "QwenImage21Transformer2DModel"
    config_class = QwenImage21TransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: QwenImage21TransformerConfig) -> None:
        super().__init__(config)
        inner = config.inner_dim
        self.time_text_embed = TimeEmbedding(inner)
        self.txt_in = TextProjection(config.context_in_dim, inner, config.eps)
        self.img_in = nn.Linear(config.in_channels, inner, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(inner, 4 * inner, bias=False))
        self.transformer_blocks = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.norm_out = OutputNorm(inner, config.eps)
        self.proj_out = nn.Linear(inner, config.out_channels, bias=False)

    def cis(self, positions: torch.Tensor, axis: int) -> torch.Tensor:
        """Complex factors of integer `positions` on one RoPE axis."""
        dim = self.config.axes_dims_rope[axis]
        device = positions.device
        inv_freq = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2, device=device).float().div(dim))
        angles = positions.to(torch.float32)[..., None] * inv_freq
        return torch.polar(torch.ones_like(angles), angles)

    def prefix(
        self, text: torch.Tensor, lengths: list[int], conditions: Sequence[Sequence[ConditionBlock]]
    ) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor, list[int]]:
        """Each sample's prefix: its embedded text with its condition images' embedded latents in place of
        their vision slots, right-padded. Returns the (B, P, dim) prefix, its valid lengths, (B, P, 3)
        RoPE positions, (B, P) block ids (-1 text) and each sample's target frame position."""
        device = text.device
        rows, positions, ids, lengths_out, frames = [], [], [], [], []
        for b, (length, blocks) in enumerate(zip(lengths, conditions, strict=True)):
            pieces, pos, id_pieces = [], [], []
            cursor, position = 0, 0
            for index, block in enumerate(blocks):
                if block.slot < cursor or block.slot + block.slots > length:
                    raise ValueError(f"condition image {index} of sample {b} lies outside its text")
                n_text = block.slot - cursor
                pieces.append(text[b, cursor : block.slot])
                pos.append(torch.arange(position, position + n_text, device=device)[:, None].expand(-1, 3))
                id_pieces.append(torch.full((n_text,), -1, device=device))
                position += n_text
                pieces.append(self.img_in(block.latents.to(text.dtype)))
                h, w = block.grid
                pos.append(self.grid_positions(position, h, w, device))
                id_pieces.append(torch.full((h * w,), index, device=device))
                position += max(h, w)
                cursor = block.slot + block.slots
            n_text = length - cursor
            pieces.append(text[b, cursor:length])
            pos.append(torch.arange(position, position + n_text, device=device)[:, None].expand(-1, 3))
            id_pieces.append(torch.full((n_text,), -1, device=device))
            rows.append(torch.cat(pieces))
            positions.append(torch.cat(pos))
            ids.append(torch.cat(id_pieces))
            lengths_out.append(rows[-1].shape[0])
            frames.append(position + n_text)
        longest = max(lengths_out)

        def pad(x: torch.Tensor, value: float) -> torch.Tensor:
            return F.pad(x, (0, 0) * (x.dim() - 1) + (0, longest - x.shape[0]), value=value)

        return (
            torch.stack([pad(r, 0.0) for r in rows]),
            lengths_out,
            torch.stack([pad(p, 0) for p in positions]),
            torch.stack([pad(i, -1) for i in ids]),
            frames,
        )

    @staticmethod
    def grid_positions(frame: int, height: int, width: int, device: torch.device) -> torch.Tensor:
        """(h * w, 3) positions of an image block at `frame`, rows and columns centred on zero."""
        rows = torch.arange(-(height - height // 2), height // 2, device=device).repeat_interleave(width)
        cols = torch.arange(-(width - width // 2), width // 2, device=device).repeat(height)
        return torch.stack([torch.full_like(rows, frame), rows, cols], dim=-1)

    def rope(self, prefix_positions: torch.Tensor, frames: list[int], grid: tuple[int, int]) -> Rope:
        """The prefix at its own positions; sample b's target at frame `frames[b]`."""
        device = prefix_positions.device
        image_positions = torch.stack([self.grid_positions(f, *grid, device) for f in frames])
        text = torch.cat([self.cis(prefix_positions[..., axis], axis) for axis in range(3)], dim=-1)
        image = torch.cat([self.cis(image_positions[..., axis], axis) for axis in range(3)], dim=-1)
        return Rope(text, image)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        text_lengths: list[int],
        timestep: torch.Tensor,
        grid: tuple[int, int],
        conditions: Sequence[Sequence[ConditionBlock]] | None = None,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """(B, h * w, in_channels) target latents (row-major over the latent `grid` (h, w)), (B, L,
        context_in_dim) prompt states right-padded past each sample's `text_lengths[b]` valid tokens,
        (B,) timesteps in [0, 1] and, per sample, its condition images (in text order; None: none) ->
        the (B, h * w, out_channels) prediction. `step_cache`: rows of requests with a cache method, which
        may reuse the blocks' residual from an earlier step (`models/step_cache.py`); None runs every block
        for every row (exact)."""
        batch, tokens, _ = hidden_states.shape
        if grid[0] * grid[1] != tokens:
            raise ValueError(f"grid {grid} does not hold {tokens} latent tokens")
        if len(text_lengths) != batch or max(text_lengths) > encoder_hidden_states.shape[1]:
            raise ValueError(
                f"text_lengths {text_lengths} do not fit text of shape {tuple(encoder_hidden_states.shape)}"
            )
        conditions = conditions if conditions is not None else [()] * batch
        if len(conditions) != batch:
            raise ValueError(f"{len(conditions)} rows of condition images for a batch of {batch}")
        image = self.img_in(hidden_states)
        text, lengths, positions, block_ids, frames = self.prefix(
            self.txt_in(encoder_hidden_states), list(text_lengths), conditions
        )
        timestep = timestep.to(image.dtype)
        causal = self.config.causal_condition
        lora_rows = current_lora_rows()
        if causal and lora_rows is not None and lora_rows.active and lora_rows.num_rows is not None:
            # The rows apply their own LoRA adapters (layers/lora_rows.py), which may reach the timestep
            # embedder and the modulation: the prefix's t = 0 row is then computed per row, as each sample
            # would get it alone (the same values without adapters).
            temb = self.time_text_embed(timestep, image.dtype)
            image_mod = self.modulation(temb)[:, None]
            text_mod = self.modulation(self.time_text_embed(timestep.new_zeros(batch), image.dtype))[:, None]
        else:
            if causal:
                timestep = torch.cat([timestep, timestep.new_zeros(1)])
            temb = self.time_text_embed(timestep, image.dtype)
            modulation = self.modulation(temb)[:, None]
            text_mod = modulation[-1:] if causal else modulation
            image_mod = modulation[:batch]
        rope = self.rope(positions, frames, grid)
        masks = AttentionMasks.of(lengths, block_ids, tokens, image.device)
        inputs = BlockInputs(text_mod, image_mod, rope, masks)
        split = sequence_split([text.shape[1], tokens])

        def run_blocks(rows: torch.Tensor | None) -> torch.Tensor:
            args = (take_rows(text, rows), take_rows(image, rows), inputs.take(rows))
            if split is None:
                return self._run_blocks(*args)
            return self._run_blocks_split(split, *args)

        def block_range() -> SequentialBlocks:
            refuse_sequence_parallel(split, "Qwen-Image 2.1")
            return self._block_range(text, image, inputs)

        image = run_with_step_cache(
            step_cache, image, lambda: self._cache_signal(image, image_mod), run_blocks, block_range
        )
        return self.proj_out(self.norm_out(image, temb[:batch]))

    def _run_blocks(self, text: torch.Tensor, image: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every block over the prefix and the image tokens; the image tokens the output head reads."""
        for block in self.transformer_blocks:
            text, image = block(text, image, inputs)
        return image

    def _cache_signal(self, image: torch.Tensor, image_mod: torch.Tensor) -> torch.Tensor:
        """The first block's modulated image input: what the step cache watches change."""
        scale = image_mod.chunk(4, dim=-1)[0]
        return self.transformer_blocks[0].norm(image) * (1 + scale)

    def _block_range(self, text: torch.Tensor, image: torch.Tensor, inputs: BlockInputs) -> SequentialBlocks:
        """The blocks as a `BlockRange` for DBCache: the image stream and the prefix (its text stream)."""

        def call(i: int, x: torch.Tensor, prefix: torch.Tensor | None, row_inputs: BlockInputs) -> tuple:
            if prefix is None:
                raise RuntimeError("Qwen-Image 2.1's blocks need the prefix stream")
            prefix, x = self.transformer_blocks[i](prefix, x, row_inputs)
            return x, prefix

        return SequentialBlocks(len(self.transformer_blocks), image, text, inputs.take, call)

    def _run_blocks_split(
        self, split: SequenceSplit, text: torch.Tensor, image: torch.Tensor, inputs: BlockInputs
    ) -> torch.Tensor:
        """The blocks with the image tokens (stream 1) split over the sequence-parallel ranks and the prefix
        (stream 0) whole on every rank (module docstring); the image tokens gathered back at the end. The
        prefix's padding (`masks.image`'s prefix keys) is the image attention's key mask."""
        target = 1
        image = split.split(target, image)
        rope = Rope(inputs.rope.text, split.split(target, inputs.rope.image))
        inputs = inputs._replace(rope=rope)
        masks = inputs.masks
        prefix_keys = None if masks.image is None else masks.image[:, 0, 0, : text.shape[1]]
        with split.attention_scope(image.shape[0], image.device, [prefix_keys, None]):
            for block in self.transformer_blocks:
                text, image = block(text, image, inputs, split)
        return split.gather(target, image)
