"""SANA-Video transformer (NVIDIA), native, loading Diffusers `SanaVideoTransformer3DModel` weights unchanged.

SANA's linear-attention DiT carried to video latents (Wan 2.1's VAE in the released 480p model):

    x    = Conv3d patchify(latents), (frame, row, column) row-major tokens          (batch, F*H*W, inner)
    rope = Wan's three-axis RoPE tables for the F x H x W token grid
    ctx  = RMSNorm(GELU-MLP(Gemma-2 states))                                          (batch, L, inner)
    emb  = MLP(sinusoids(t));  mods = Linear(SiLU(emb))                              adaLN-single
    num_layers x block:
        x += gate_msa * ReLU-linear-attention(adaLN(x), rope)   numerator on RoPE-rotated q, k;
                                                                normaliser on the unrotated ones
        x += softmax cross-attention(x, ctx, text mask)         no norm, no gate (as SANA)
        x += gate_mlp * GLUMBTempConv(adaLN(x))                 SANA's Mix-FFN per frame, then a
                                                                residual 3-tap temporal conv
    out  = proj_out(adaLN(x, emb)) unpatchified to (batch, out_channels, frames, height, width)

The linear attention per head: out_i = sum_j (q~_i . k~_j) v_j / sum_j (q_i . k_j), with q, k = ReLU(.)
and q~, k~ their RoPE rotations. The products run in float32, the normaliser in the activation dtype
(as in Diffusers).

What SANA-Video shares with SANA's image DiT comes from `models/dits/sana_blocks.py` (adaLN-single, the
guidance embedding, the masked cross-attention, the block's modulated residuals, the text conditioning,
block loop and output head) and `layers/` (GLUMBConv, the RoPE rotation and tables, Wan's split of a
head over the three axes).

Timestep convention: `forward(timestep=...)` embeds the values as given (Diffusers' pipeline passes the
scheduler's t in [0, 1000]).

Differences from Diffusers that do not change the numbers: the RoPE tables are half width, built for the
token grid only (not `rope_max_seq_len` positions) and rotated in float32 (Diffusers rotates in float64
and rounds to float32); text can be embedded once per request (`embed_context`); the timestep embedding
is computed once per forward for the blocks and the head.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): the video is split over the
sequence-parallel ranks by whole latent frames (`sequence_split` over the frame axis, the last shards
padded with zero frames), each rank holding its frames' tokens and RoPE rows (`FrameShard`). The linear
attention's sums over the tokens (sum_j k~_j v_j^T and sum_j k_j) are all-reduced over the ranks, the
padded frames' keys zeroed first; the Mix-FFN is per frame and runs locally; the 3-tap temporal conv reads
the neighbouring ranks' edge frames (one all-gather of two frames per rank); the cross-attention reads the
replicated text. The frames are gathered before the output head. The sums are reordered (one partial
sum per rank), so the split equals the one-device forward up to float rounding. DBCache (block ranges)
is refused under the split. With one sequence-parallel rank nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from diffserve.distributed.sequence_parallel import SequenceShard
from diffserve.distributed.sequence_split import SequenceSplit, sequence_split
from diffserve.layers.glumbconv import GLUMBConv
from diffserve.layers.norms import LayerNorm
from diffserve.layers.rotary import RopeTables, RotaryEmbedding
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.dits.base import DiTConfig
from diffserve.models.dits.input_checks import check_one_text_input, check_per_sample
from diffserve.models.dits.sana_blocks import (
    LINEAR_ATTENTION_EPS,
    SUPPORTED_QK_NORMS,
    BlockInputs,
    LinearAttentionWeights,
    SanaBlockBase,
    SanaDiTBase,
    check_text_cross_attention,
)
from diffserve.models.dits.wan import wan_grid_rope_tables, wan_rope_axes_dims
from diffserve.models.step_cache import BatchStepCache

#: Tables kept per (grid, device).
ROPE_CACHE_SIZE = 8


@dataclass(frozen=True)
class SanaVideoTransformerConfig(DiTConfig):
    """The SANA-Video DiT's Diffusers config (`transformer/config.json`), one field per key, Diffusers'
    defaults (the 2B 480p model). `sample_size` (30: 480p, 22: 720p) picks the pipeline's aspect-ratio
    bins; `dropout` and `interpolation_scale` are accepted and unused, as in Diffusers."""

    in_channels: int = 16
    out_channels: int | None = 16
    num_attention_heads: int = 20
    attention_head_dim: int = 112
    num_layers: int = 20
    num_cross_attention_heads: int | None = 20
    cross_attention_head_dim: int | None = 112
    cross_attention_dim: int | None = 2240
    caption_channels: int = 2304
    mlp_ratio: float = 2.5
    dropout: float = 0.0
    attention_bias: bool = False
    sample_size: int = 30
    patch_size: tuple[int, int, int] = (1, 2, 2)
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    interpolation_scale: int | None = None
    guidance_embeds: bool = False
    guidance_embeds_scale: float = 0.1
    qk_norm: str | None = "rms_norm_across_heads"
    rope_max_seq_len: int = 1024

    def __post_init__(self) -> None:
        patch = tuple(int(p) for p in self.patch_size)
        if len(patch) != 3:
            raise ValueError(
                f"SanaVideoTransformer3DModel: patch_size must be (t, h, w), got {self.patch_size}"
            )
        self._normalise(patch_size=patch, out_channels=self.out_channels or self.in_channels)
        if self.qk_norm not in SUPPORTED_QK_NORMS:
            raise ValueError(
                f"SanaVideoTransformer3DModel: qk_norm={self.qk_norm!r} is not supported; one of "
                f"{SUPPORTED_QK_NORMS}"
            )
        check_text_cross_attention(self, "SanaVideoTransformer3DModel")
        if any(d % 2 for d in wan_rope_axes_dims(self.attention_head_dim)):
            raise ValueError(
                f"SanaVideoTransformer3DModel: attention_head_dim {self.attention_head_dim} splits into odd "
                f"RoPE axes {wan_rope_axes_dims(self.attention_head_dim)}"
            )


@dataclass(frozen=True)
class FrameShard:
    """This rank's latent frames of a video split over the sequence-parallel ranks by whole frames: what
    the blocks need for the sums and the temporal conv that cross the shards."""

    shard: SequenceShard  # over the frame axis: `shard_len` local frames, the last ones maybe padding
    group: ProcessGroup  # every sequence-parallel rank, in shard order
    tokens_per_frame: int

    def token_valid(self, device: torch.device) -> torch.Tensor:
        """(local tokens,) bool: False on the tokens of padded frames."""
        frames = torch.arange(self.shard.shard_len, device=device) < self.shard.valid_len
        return frames.repeat_interleave(self.tokens_per_frame)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over every rank of the split."""
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def with_neighbours(self, temporal: torch.Tensor) -> torch.Tensor:
        """(batch, C, local frames, pixels) -> (batch, C, local frames + 2, pixels): the padded frames
        zeroed, the previous rank's last frame before them and the next rank's first frame after (zeros
        past the video's ends), what a 3-tap conv along the frames reads at the shard's edges."""
        valid = self.shard.valid_len
        if valid < self.shard.shard_len:
            temporal = torch.cat(
                [temporal[:, :, :valid], temporal.new_zeros(temporal[:, :, valid:].shape)], 2
            )
        edges = torch.cat([temporal[:, :, :1], temporal[:, :, -1:]], dim=2).contiguous()
        parts = [torch.empty_like(edges) for _ in range(self.shard.degree)]
        dist.all_gather(parts, edges, group=self.group)
        index, zero = self.shard.index, torch.zeros_like(edges[:, :, :1])
        before = parts[index - 1][:, :, 1:] if index > 0 else zero
        after = parts[index + 1][:, :, :1] if index + 1 < self.shard.degree else zero
        return torch.cat([before, temporal, after], dim=2)


class SanaVideoLinearAttention(LinearAttentionWeights):
    """ReLU linear self-attention with RoPE on its numerator (see the module docstring)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, bias: bool, qk_norm: bool) -> None:
        super().__init__(dim, num_heads, head_dim, bias, qk_norm)
        self.rope = RotaryEmbedding()

    def forward(self, x: torch.Tensor, rope: RopeTables, frames: FrameShard | None = None) -> torch.Tensor:
        """(batch, tokens, dim) -> (batch, tokens, dim); `rope`: (tokens, head_dim / 2) tables. `frames`:
        under a sequence split, this rank's frames; the sums over the tokens then cover every rank's."""
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        # (batch, tokens, heads, head_dim)
        q, k, v = (t.unflatten(2, (self.num_heads, -1)) for t in (q, k, v))
        q, k = F.relu(q), F.relu(k)
        q_rot, k_rot = self.rope(q, k, *rope)
        # (batch, heads, head_dim, tokens)
        q, k = q.permute(0, 2, 3, 1), k.permute(0, 2, 3, 1)
        q_rot, k_rot, v = (t.permute(0, 2, 3, 1).float() for t in (q_rot, k_rot, v))
        if frames is not None:
            return self._split_output(x, q, k, q_rot, k_rot, v, frames)
        normaliser = 1 / (k.sum(dim=-1, keepdim=True).transpose(-2, -1) @ q + LINEAR_ATTENTION_EPS)
        out = ((v @ k_rot.transpose(-1, -2)) @ q_rot) * normaliser
        out = out.flatten(1, 2).transpose(1, 2).to(x.dtype)
        return self.to_out[0](out)

    def _split_output(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_rot: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        frames: FrameShard,
    ) -> torch.Tensor:
        """`forward`'s output from (batch, heads, head_dim, local tokens) q, k (and rotated) and v, with
        the key sums all-reduced over the ranks; the padded frames' keys are zeroed first."""
        padding = ~frames.token_valid(k.device)
        k, k_rot = k.masked_fill(padding, 0), k_rot.masked_fill(padding, 0)
        key_sum = frames.all_reduce(k.sum(dim=-1, keepdim=True))
        normaliser = 1 / (key_sum.transpose(-2, -1) @ q + LINEAR_ATTENTION_EPS)
        out = (frames.all_reduce(v @ k_rot.transpose(-1, -2)) @ q_rot) * normaliser
        out = out.flatten(1, 2).transpose(1, 2).to(x.dtype)
        return self.to_out[0](out)


class GLUMBTempConv(GLUMBConv):
    """SANA's Mix-FFN on every frame, then `h + conv_temp(h)`: a 3-tap convolution along the frames of
    each channel and pixel (Diffusers' `GLUMBTempConv`, no norm, no outer residual)."""

    def __init__(self, dim: int, expand_ratio: float) -> None:
        super().__init__(dim, dim, expand_ratio)
        self.conv_temp = nn.Conv2d(dim, dim, kernel_size=(3, 1), padding=(1, 0), bias=False)

    def forward_video(
        self, x: torch.Tensor, frames: int, height: int, width: int, shard: FrameShard | None = None
    ) -> torch.Tensor:
        """(batch, frames * height * width, dim) tokens -> the same shape. `shard`: under a sequence split,
        this rank's `frames`; the temporal conv then reads the neighbouring ranks' edge frames."""
        batch, _, dim = x.shape
        maps = x.reshape(batch * frames, height, width, dim).permute(0, 3, 1, 2)
        h = super().forward(maps)  # (batch * frames, dim, height, width)
        temporal = h.view(batch, frames, dim, height * width).permute(0, 2, 1, 3)  # (B, C, F, HW)
        if shard is None:
            temporal = temporal + self.conv_temp(temporal)
        else:
            temporal = temporal + self.conv_temp(shard.with_neighbours(temporal))[:, :, 1:-1]
        return temporal.permute(0, 2, 3, 1).reshape(batch, frames * height * width, dim)


class SanaVideoTransformerBlock(SanaBlockBase):
    """Linear self-attention with RoPE, cross-attention to the text, GLUMBTempConv; adaLN-single modulated."""

    def __init__(self, config: SanaVideoTransformerConfig) -> None:
        super().__init__(config, SanaVideoLinearAttention, GLUMBTempConv)
        self.scale_shift_table = nn.Parameter(torch.randn(6, self.dim) / self.dim**0.5)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        mask_bias: torch.Tensor | None,
        modulation: torch.Tensor,
        rope: RopeTables,
        grid: tuple[int, int, int],
        frames: FrameShard | None = None,
    ) -> torch.Tensor:
        """x (batch, F*H*W, dim); modulation (batch, 6 * dim); grid the (F, H, W) token grid (this rank's
        frames under a sequence split, `frames` then telling which they are)."""
        return self.modulated(
            lambda h: self.attn1(h, rope, frames),
            lambda h: self.ff.forward_video(h, *grid, frames),
            x,
            ctx,
            mask_bias,
            modulation,
        )


class SanaVideoTransformer3DModel(SanaDiTBase):
    """SANA-Video DiT with Diffusers' config keys and state-dict names.

    forward(hidden_states (B, in_channels, F, H, W) latents,
            encoder_hidden_states (B, L, caption_channels) Gemma-2 states, or None with context=,
            encoder_attention_mask (B, L) 1 = token / 0 = padding, or None,
            timestep (B,) or (1,) embedded as given,
            guidance (B,) or (1,) for guidance_embeds checkpoints (already x guidance_embeds_scale),
            context=embed_context(encoder_hidden_states))
        -> (B, out_channels, F, H, W) flow velocity.
    """

    diffusers_class_name: ClassVar[str] = "SanaVideoTransformer3DModel"
    config_class = SanaVideoTransformerConfig

    def __init__(self, config: SanaVideoTransformerConfig) -> None:
        super().__init__(config)
        inner = config.inner_dim
        patch = config.patch_size
        self.patch_embedding = nn.Conv3d(config.in_channels, inner, kernel_size=patch, stride=patch)
        self._build_shared_layers(config, SanaVideoTransformerBlock)
        self.scale_shift_table = nn.Parameter(torch.randn(2, inner) / inner**0.5)
        self.norm_out = LayerNorm(inner, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(inner, math.prod(patch) * int(config.out_channels))
        self.rope_axes_dims = wan_rope_axes_dims(config.attention_head_dim)
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache(ROPE_CACHE_SIZE)

    def rope_tables(self, frames: int, height: int, width: int, device: torch.device) -> RopeTables:
        """Wan's half-width (cos, sin) float32 tables (frames*height*width, head_dim // 2) for a post-patch
        grid (`wan_grid_rope_tables`), cached per grid and device."""
        grid = (frames, height, width)
        build = partial(
            wan_grid_rope_tables, *grid, self.rope_axes_dims, self.config.rope_max_seq_len, device
        )
        return self._rope_cache.get_or_build(grid, device, build)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        guidance: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity of video latents (see the class docstring for the arguments);
        `step_cache`: rows of requests with a cache method (`models/step_cache.py`), None runs every block."""
        if hidden_states.ndim != 5:
            raise ValueError(
                f"hidden_states must be (batch, C, frames, H, W) latents, got {tuple(hidden_states.shape)}"
            )
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        if frames % p_t or height % p_h or width % p_w:
            raise ValueError(
                f"latent grid {frames}x{height}x{width} is not a multiple of patch_size {self.config.patch_size}"
            )
        check_per_sample(batch, timestep=timestep, guidance=guidance)
        check_one_text_input(encoder_hidden_states, context, "Gemma-2 states")

        grid = (frames // p_t, height // p_h, width // p_w)
        rope = self.rope_tables(*grid, hidden_states.device)
        tokens = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
        x = self._predict_tokens(
            tokens,
            (rope, grid),
            step_cache,
            timestep,
            guidance,
            encoder_hidden_states,
            encoder_attention_mask,
            context,
        )
        f, h, w = grid
        x = x.reshape(batch, f, h, w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(batch, -1, f * p_t, h * p_h, w * p_w)

    def _run_blocks(self, x: torch.Tensor, inputs: BlockInputs, layout: tuple[object, ...]) -> torch.Tensor:
        """Every block, in order, on `layout` (the RoPE tables and the grid); under sequence parallelism
        split by whole frames (`_run_blocks_split`)."""
        rope, grid = layout
        split = sequence_split([grid[0]])  # by whole frames
        if split is not None:
            return self._run_blocks_split(split, x, inputs, rope, grid)
        return super()._run_blocks(x, inputs, layout)

    def _run_blocks_split(
        self,
        split: SequenceSplit,
        x: torch.Tensor,
        inputs: BlockInputs,
        rope: RopeTables,
        grid: tuple[int, int, int],
    ) -> torch.Tensor:
        """`_run_blocks` with the video split over the sequence-parallel ranks by whole frames (module
        docstring): the tokens and RoPE rows of this rank's frames, the blocks on the local (frames, H, W)
        grid, the frames gathered back at the end."""
        frames, height, width = grid
        shard = FrameShard(split.shards[0], split.group, height * width)

        def by_frame(t: torch.Tensor, dim: int) -> torch.Tensor:
            local = split.split(0, t.unflatten(dim, (frames, height * width)), dim=dim)
            return local.flatten(dim, dim + 1)

        x, rope = by_frame(x, 1), (by_frame(rope[0], 0), by_frame(rope[1], 0))
        local_grid = (shard.shard.shard_len, height, width)
        for block in self.transformer_blocks:
            x = block(x, *inputs, rope, local_grid, shard)
        return split.gather(0, x.unflatten(1, (local_grid[0], height * width)), dim=1).flatten(1, 2)

    def _block_range(
        self, x: torch.Tensor, inputs: BlockInputs, layout: tuple[object, ...]
    ) -> SequentialBlocks:
        """The blocks as a `BlockRange` for DBCache: one video stream (the text is context no block changes);
        refused under a sequence split."""
        refuse_sequence_parallel(sequence_split([x.shape[1]]), "SANA-Video")
        return super()._block_range(x, inputs, layout)
