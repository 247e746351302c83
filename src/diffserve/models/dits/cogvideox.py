"""CogVideoX transformer (THUDM / Zhipu AI), native, loading Diffusers `CogVideoXTransformer3DModel` weights
unchanged: CogVideoX 1.0 (2B, 5B, 5B-I2V) and 1.5 (5B, 5B-I2V).

    text = text_proj(T5 states)                                          (batch, L, inner)
    x    = patchify(latents): 1.0 a 2-D conv per frame, p x p patches; 1.5 a Linear over p_t x p x p cells
    x    = [text; x] (+ 3-D sin-cos or learned positions over [zeros for text; video tokens])
    emb  = MLP(sinusoids(t)) (+ MLP(sinusoids(ofs)), 1.5 I2V)
    num_layers x block (text and video in one sequence, each stream with its own adaLN-zero modulation):
        [text; x] += gates * attention(LayerNorm(.) * (1 + scale) + shift), q/k LayerNorm per head,
                     3-D RoPE on the video tokens' q and k (rotary models)
        [text; x] += gates * GELU-MLP(LayerNorm(.) * (1 + scale) + shift)
    out  = proj_out(adaLN(LayerNorm(x), emb)) unpatchified to (batch, frames, channels, height, width)

Inputs and outputs are in Diffusers' layout, (batch, frames, channels, height, width). The text must be as
long as `max_text_seq_length` when the model adds positions (the sin-cos or learned table covers that many
text slots), as in Diffusers, where the pipeline pads T5's tokens to 226.

Positions, as Diffusers' pipeline and patch embedding make them:
- sin-cos (`use_rotary_positional_embeddings` false, CogVideoX-2B): 3/4 of the width over the (column, row)
  grid scaled by 1 / spatial_interpolation_scale, 1/4 over frames / temporal_interpolation_scale, computed
  in float64 for the input's grid;
- learned (5B-I2V): the checkpoint's table, for the configured sample size only; a clip of another length
  gets the sin-cos table instead (Diffusers recomputes it then);
- RoPE (5B, 1.5): head_dim / 4 over frames, 3/8 over rows and 3/8 over columns, interleaved pairs, base
  10000. 1.0 spreads the rows and columns over the crop of the (sample_height, sample_width) / p grid that
  the video's grid resizes to (`linspace`); 1.5 numbers them 0, 1, 2, ... up to that grid (`slice`).

Timesteps are embedded per sample, so requests at different steps share one forward.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): the text and the video tokens
are two streams, each split over the sequence-parallel ranks after the positions are added (so every token
keeps its own); the RoPE rows are cut with the video tokens. Every block's attention runs over the local
[text; video] shards with `sequence_attention` (the shards' padding masked; CogVideoX has no text mask),
everything else in a block is per token, and the video tokens are gathered before the output head. With
one sequence-parallel rank nothing changes.

Cache methods (`models/step_cache.py`, issue 33): the cached span is every block, from the video tokens
after the positions to those `norm_final` reads; the watched signal is the first block's modulated video
input. DBCache counts the blocks as cache-dit's CogVideoX adapter does and runs them in ranges on (video,
text) streams; it is refused under a sequence split (`refuse_sequence_parallel`), the whole-span methods
run there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import SequenceSplit, sequence_attention, sequence_split
from diffserve.layers.attention_reuse import ReusableAttention
from diffserve.layers.embeddings import TimestepEmbedding, timestep_sinusoids
from diffserve.layers.feedforward import FeedForward
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.block_inputs import run_streams_with_step_cache
from diffserve.models.step_cache import BatchStepCache, take_rows

ROPE_THETA = 10000.0
#: Position tables kept per (grid, device).
ROPE_CACHE_SIZE = 8
#: Diffusers' Attention eps for the per-head q/k LayerNorms of this DiT.
QK_NORM_EPS = 1e-6
_ACTIVATIONS = {"gelu-approximate": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class CogVideoXTransformerConfig(DiTConfig):
    """The CogVideoX DiT's Diffusers config (`transformer/config.json`), one field per key, Diffusers'
    defaults. `dropout` is accepted and unused (inference)."""

    num_attention_heads: int = 30
    attention_head_dim: int = 64
    in_channels: int = 16
    out_channels: int | None = 16
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    time_embed_dim: int = 512
    ofs_embed_dim: int | None = None
    text_embed_dim: int = 4096
    num_layers: int = 30
    dropout: float = 0.0
    attention_bias: bool = True
    sample_width: int = 90
    sample_height: int = 60
    sample_frames: int = 49
    patch_size: int = 2
    patch_size_t: int | None = None
    temporal_compression_ratio: int = 4
    max_text_seq_length: int = 226
    activation_fn: str = "gelu-approximate"
    timestep_activation_fn: str = "silu"
    norm_elementwise_affine: bool = True
    norm_eps: float = 1e-5
    spatial_interpolation_scale: float = 1.875
    temporal_interpolation_scale: float = 1.0
    use_rotary_positional_embeddings: bool = False
    use_learned_positional_embeddings: bool = False
    patch_bias: bool = True

    def __post_init__(self) -> None:
        name = "CogVideoXTransformer3DModel"
        if not self.use_rotary_positional_embeddings and self.use_learned_positional_embeddings:
            raise ValueError(f"{name}: learned positions without rotary ones match no CogVideoX checkpoint")
        if self.activation_fn not in _ACTIVATIONS:
            raise ValueError(
                f"{name}: activation_fn must be one of {sorted(_ACTIVATIONS)}, got {self.activation_fn!r}"
            )
        if self.timestep_activation_fn != "silu":
            raise ValueError(
                f"{name}: timestep_activation_fn must be silu, got {self.timestep_activation_fn!r}"
            )
        if self.use_rotary_positional_embeddings and self.attention_head_dim % 16:
            raise ValueError(
                f"{name}: attention_head_dim must be a multiple of 16 with rotary positions (a quarter of it "
                f"over frames and 3/8 over rows and over columns, each split in pairs), got "
                f"{self.attention_head_dim}"
            )
        if self.sincos_positions and self.inner_dim % 16:
            raise ValueError(
                f"{name}: num_attention_heads * attention_head_dim must be a multiple of 16 with added "
                f"positions (3/8 of it over rows and over columns, 1/4 over frames, each in sin-cos pairs), "
                f"got {self.inner_dim}"
            )
        if self.ofs_embed_dim and self.ofs_embed_dim != self.time_embed_dim:
            raise ValueError(
                f"{name}: ofs_embed_dim ({self.ofs_embed_dim}) must equal time_embed_dim "
                f"({self.time_embed_dim}): the ofs embedding is added to the timestep embedding"
            )
        if self.out_channels is None:
            self._normalise(out_channels=self.in_channels)

    @property
    def sincos_positions(self) -> bool:
        """Whether positions are added to the tokens (sin-cos, or the learned table) rather than rotated in."""
        return not self.use_rotary_positional_embeddings or self.use_learned_positional_embeddings


def _sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """(len(positions), dim) float64 [sin | cos] of positions / 10000^(2i/dim)."""
    omega = torch.arange(dim // 2, dtype=torch.float64, device=positions.device) / (dim / 2.0)
    angles = torch.outer(positions.to(torch.float64).reshape(-1), 1.0 / 10000**omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_positions_3d(
    dim: int, grid_h: int, grid_w: int, frames: int, spatial_scale: float, temporal_scale: float, device=None
) -> torch.Tensor:
    """(frames * grid_h * grid_w, dim) float64 positions: [temporal (dim / 4) | column (3 dim / 8) | row
    (3 dim / 8)], tokens frame-major then row-major, as Diffusers' `get_3d_sincos_pos_embed`."""
    spatial, temporal = 3 * dim // 4, dim // 4
    rows = torch.arange(grid_h, dtype=torch.float32, device=device) / spatial_scale
    cols = torch.arange(grid_w, dtype=torch.float32, device=device) / spatial_scale
    col_grid = cols[None, :].expand(grid_h, grid_w)
    row_grid = rows[:, None].expand(grid_h, grid_w)
    per_pixel = torch.cat([_sincos_1d(spatial // 2, col_grid), _sincos_1d(spatial // 2, row_grid)], dim=1)
    times = torch.arange(frames, dtype=torch.float32, device=device) / temporal_scale
    per_frame = _sincos_1d(temporal, times)
    per_pixel = per_pixel[None].expand(frames, -1, -1)
    per_frame = per_frame[:, None].expand(-1, grid_h * grid_w, -1)
    return torch.cat([per_frame, per_pixel], dim=-1).reshape(frames * grid_h * grid_w, dim)


def _rope_1d(dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(len, dim) float32 cos and sin of positions / theta^(2i/dim), each repeated for an interleaved pair."""
    freqs = 1.0 / (
        ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    )
    angles = torch.outer(positions, freqs)
    return angles.cos().repeat_interleave(2, dim=1), angles.sin().repeat_interleave(2, dim=1)


def _resize_crop(
    grid_h: int, grid_w: int, base_w: int, base_h: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (top, left), (bottom, right) of the grid resized into the base grid and centred (Diffusers'
    `get_resize_crop_region_for_grid`)."""
    if grid_h / grid_w > base_h / base_w:
        height, width = base_h, int(round(base_h / grid_h * grid_w))
    else:
        width, height = base_w, int(round(base_w / grid_w * grid_h))
    top, left = int(round((base_h - height) / 2.0)), int(round((base_w - width) / 2.0))
    return (top, left), (top + height, left + width)


def rope_tables(
    config: CogVideoXTransformerConfig, frames: int, grid_h: int, grid_w: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, head_dim) float32 cos and sin for a video of `frames` latent frames (padded, 1.5) on a
    `grid_h` x `grid_w` patch grid, as Diffusers' pipelines build `image_rotary_emb`."""
    dim = config.attention_head_dim
    p = config.patch_size
    base_h, base_w = config.sample_height // p, config.sample_width // p
    if config.patch_size_t is None:
        (top, left), (bottom, right) = _resize_crop(grid_h, grid_w, base_w, base_h)
        rows = torch.linspace(top, bottom * (grid_h - 1) / grid_h, grid_h, dtype=torch.float32, device=device)
        cols = torch.linspace(left, right * (grid_w - 1) / grid_w, grid_w, dtype=torch.float32, device=device)
        times = torch.linspace(0, frames * (frames - 1) / frames, frames, dtype=torch.float32, device=device)
    else:
        frames = (frames + config.patch_size_t - 1) // config.patch_size_t
        if grid_h > base_h or grid_w > base_w:
            raise ValueError(
                f"CogVideoXTransformer3DModel: a {grid_h} x {grid_w} patch grid is larger than the model's "
                f"{base_h} x {base_w} positions (sample_height / sample_width); Diffusers cannot run it either"
            )
        rows = torch.arange(grid_h, dtype=torch.float32, device=device)
        cols = torch.arange(grid_w, dtype=torch.float32, device=device)
        times = torch.arange(frames, dtype=torch.float32, device=device)
    dim_t, dim_s = dim // 4, dim // 8 * 3
    tables = []
    for part in range(2):  # cos, then sin
        t = _rope_1d(dim_t, times)[part][:, None, None].expand(-1, grid_h, grid_w, -1)
        h = _rope_1d(dim_s, rows)[part][None, :, None].expand(frames, -1, grid_w, -1)
        w = _rope_1d(dim_s, cols)[part][None, None, :].expand(frames, grid_h, -1, -1)
        tables.append(torch.cat([t, h, w], dim=-1).reshape(frames * grid_h * grid_w, -1))
    return tables[0], tables[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of (batch, tokens, heads, head_dim) `x` in float32, back in x's dtype."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class LayerNormZero(nn.Module):
    """CogVideoX's adaLN-zero for the joint sequence: one Linear(SiLU(emb)) gives shift, scale and gate of the
    video stream and of the text stream; both go through the same LayerNorm."""

    def __init__(self, conditioning_dim: int, dim: int, affine: bool, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(conditioning_dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=affine)

    def forward(
        self, x: torch.Tensor, text: torch.Tensor, emb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        shift, scale, gate, t_shift, t_scale, t_gate = self.linear(F.silu(emb)).chunk(6, dim=1)
        x = self.norm(x) * (1 + scale)[:, None] + shift[:, None]
        text = self.norm(text) * (1 + t_scale)[:, None] + t_shift[:, None]
        return x, text, gate[:, None], t_gate[:, None]


class JointAttention(ReusableAttention):
    """Self-attention over [text; video] with per-head q/k LayerNorms and RoPE on the video tokens."""

    def __init__(self, dim: int, heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(dim, inner, bias=bias)
        self.to_v = nn.Linear(dim, inner, bias=bias)
        self.norm_q = nn.LayerNorm(head_dim, eps=QK_NORM_EPS)
        self.norm_k = nn.LayerNorm(head_dim, eps=QK_NORM_EPS)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(
        self, tokens: torch.Tensor, text_len: int, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        b, n, _ = tokens.shape
        q = self.norm_q(self.to_q(tokens).view(b, n, self.heads, self.head_dim))
        k = self.norm_k(self.to_k(tokens).view(b, n, self.heads, self.head_dim))
        v = self.to_v(tokens).view(b, n, self.heads, self.head_dim)
        if rope is not None:
            q = torch.cat([q[:, :text_len], apply_rope(q[:, text_len:], *rope)], dim=1)
            k = torch.cat([k[:, :text_len], apply_rope(k[:, text_len:], *rope)], dim=1)
        # Over every rank's tokens inside a sequence-split scope; plain attention on one rank.
        return self.to_out[0](sequence_attention(q, k, v).reshape(b, n, -1))


class CogVideoXBlock(nn.Module):
    def __init__(self, config: CogVideoXTransformerConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        affine, eps = config.norm_elementwise_affine, config.norm_eps
        self.norm1 = LayerNormZero(config.time_embed_dim, dim, affine, eps)
        self.attn1 = JointAttention(
            dim, config.num_attention_heads, config.attention_head_dim, config.attention_bias
        )
        self.norm2 = LayerNormZero(config.time_embed_dim, dim, affine, eps)
        self.ff = FeedForward(dim, approximate=_ACTIVATIONS[config.activation_fn])

    def forward(
        self,
        x: torch.Tensor,
        text: torch.Tensor,
        emb: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = text.shape[1]
        normed, normed_text, gate, text_gate = self.norm1(x, text, emb)
        out = self.attn1(torch.cat([normed_text, normed], dim=1), n, rope)
        x = x + gate * out[:, n:]
        text = text + text_gate * out[:, :n]
        normed, normed_text, gate, text_gate = self.norm2(x, text, emb)
        out = self.ff(torch.cat([normed_text, normed], dim=1))
        return x + gate * out[:, n:], text + text_gate * out[:, :n]


class PatchEmbed(nn.Module):
    """Text projection, video patches (1.0: a Conv2d per frame; 1.5: a Linear over p_t x p x p cells), and the
    learned position table when the model has one (a persistent buffer, as in Diffusers)."""

    def __init__(self, config: CogVideoXTransformerConfig) -> None:
        super().__init__()
        c, p, inner = config.in_channels, config.patch_size, config.inner_dim
        if config.patch_size_t is None:
            self.proj: nn.Module = nn.Conv2d(c, inner, kernel_size=p, stride=p, bias=config.patch_bias)
        else:
            self.proj = nn.Linear(c * p * p * config.patch_size_t, inner)
        self.text_proj = nn.Linear(config.text_embed_dim, inner)
        if config.use_learned_positional_embeddings:
            frames = (config.sample_frames - 1) // config.temporal_compression_ratio + 1
            patches = (config.sample_height // p) * (config.sample_width // p) * frames
            self.register_buffer(
                "pos_embedding", torch.zeros(1, config.max_text_seq_length + patches, inner), persistent=True
            )

    def patches(self, video: torch.Tensor, config: CogVideoXTransformerConfig) -> torch.Tensor:
        """(batch, frames, channels, H, W) -> (batch, tokens, inner), frame-major then row-major."""
        b, f, c, h, w = video.shape
        p = config.patch_size
        if config.patch_size_t is None:
            x = self.proj(video.reshape(b * f, c, h, w))
            return x.view(b, f, *x.shape[1:]).flatten(3).transpose(2, 3).flatten(1, 2)
        pt = config.patch_size_t
        x = video.permute(0, 1, 3, 4, 2).reshape(b, f // pt, pt, h // p, p, w // p, p, c)
        x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(4, 7).flatten(1, 3)
        return self.proj(x)


class BlockInputs(NamedTuple):
    """What every block reads besides the video and text streams: the time embedding of these rows and the
    RoPE tables (shared by every row; None without rotary embeddings)."""

    emb: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None

    def take(self, rows: torch.Tensor | None) -> BlockInputs:
        """These inputs for batch rows `rows` (None: all)."""
        return BlockInputs(take_rows(self.emb, rows), self.rope)


class CogVideoXTransformer3DModel(DiffusersDiT):
    diffusers_class_name: ClassVar[str] = "CogVideoXTransformer3DModel"
    config_class = CogVideoXTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: CogVideoXTransformerConfig) -> None:
        super().__init__(config)
        inner = config.inner_dim
        self.patch_embed = PatchEmbed(config)
        self.time_embedding = TimestepEmbedding(inner, config.time_embed_dim)
        self.ofs_embedding = (
            TimestepEmbedding(config.ofs_embed_dim, config.ofs_embed_dim) if config.ofs_embed_dim else None
        )
        self.transformer_blocks = nn.ModuleList([CogVideoXBlock(config) for _ in range(config.num_layers)])
        self.norm_final = nn.LayerNorm(inner, config.norm_eps, config.norm_elementwise_affine)
        self.norm_out = _AdaLayerNormOut(
            config.time_embed_dim, inner, config.norm_elementwise_affine, config.norm_eps
        )
        p, pt = config.patch_size, config.patch_size_t or 1
        self.proj_out = nn.Linear(inner, p * p * pt * config.out_channels)
        #: Per (latent grid, device): the RoPE tables and the computed sin-cos positions (float64, cast
        #: per forward), built once per shape rather than at every step.
        self._tables: BoundedCache[object] = BoundedCache(ROPE_CACHE_SIZE)

    def embed_time(
        self, timestep: torch.Tensor, ofs: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        c = self.config
        sinusoids = timestep_sinusoids(timestep, self.inner_dim, c.flip_sin_to_cos, c.freq_shift).to(dtype)
        emb = self.time_embedding(sinusoids)
        if self.ofs_embedding is not None:
            if ofs is None:
                raise ValueError("this CogVideoX DiT embeds an ofs value (ofs_embed_dim is set): pass ofs")
            ofs_sin = timestep_sinusoids(ofs, c.ofs_embed_dim, c.flip_sin_to_cos, c.freq_shift).to(dtype)
            emb = emb + self.ofs_embedding(ofs_sin)
        return emb

    def positions(self, frames: int, height: int, width: int, text_len: int, device, dtype) -> torch.Tensor:
        """(1, text_len + tokens, inner) positions added to [text; video] (zeros on the text), as Diffusers'
        patch embedding adds them."""
        c = self.config
        p = c.patch_size
        if text_len != c.max_text_seq_length:
            raise ValueError(
                f"this CogVideoX DiT adds positions over {c.max_text_seq_length} text slots "
                f"(max_text_seq_length); got {text_len} text tokens"
            )
        learned = c.use_learned_positional_embeddings
        if learned and (c.sample_height != height or c.sample_width != width):
            raise ValueError(
                f"this CogVideoX DiT has learned positions for {c.sample_height * 8} x {c.sample_width * 8}-pixel "
                f"videos only (latents {c.sample_height} x {c.sample_width}); got latents {height} x {width}"
            )
        pixel_frames = (frames - 1) * c.temporal_compression_ratio + 1
        if learned and pixel_frames == c.sample_frames:
            return self.patch_embed.pos_embedding.to(dtype)
        grid_frames = (pixel_frames - 1) // c.temporal_compression_ratio + 1

        def build() -> torch.Tensor:
            table = sincos_positions_3d(
                self.inner_dim,
                height // p,
                width // p,
                grid_frames,
                c.spatial_interpolation_scale,
                c.temporal_interpolation_scale,
                device,
            )
            return torch.cat([table.new_zeros(text_len, self.inner_dim), table])[None]

        key = ("sincos", grid_frames, height, width, text_len)
        return self._tables.get_or_build(key, device, build).to(dtype)

    def rope(self, frames: int, height: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        c = self.config
        if not c.use_rotary_positional_embeddings:
            return None
        p = c.patch_size
        build = partial(rope_tables, c, frames, height // p, width // p, device)
        return self._tables.get_or_build(("rope", frames, height, width), device, build)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        ofs: torch.Tensor | None = None,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """(batch, frames, channels, H, W) latents, (batch, L, text_embed_dim) T5 states and (batch,)
        timesteps -> (batch, frames, out_channels, H, W). `step_cache`: rows of requests with a cache
        method, which may reuse the blocks' residual from an earlier step; None runs every block (exact)."""
        c = self.config
        b, f, _, h, w = hidden_states.shape
        dtype = hidden_states.dtype
        emb = self.embed_time(timestep, ofs, dtype)
        text = self.patch_embed.text_proj(encoder_hidden_states)
        tokens = torch.cat([text, self.patch_embed.patches(hidden_states, c)], dim=1)
        n = text.shape[1]
        if c.sincos_positions:
            tokens = tokens + self.positions(f, h, w, n, tokens.device, tokens.dtype)
        text, x = tokens[:, :n], tokens[:, n:]
        inputs = BlockInputs(emb, self.rope(f, h, w, hidden_states.device))

        def signal() -> torch.Tensor:
            return self.transformer_blocks[0].norm1(x, text, emb)[0]

        x = run_streams_with_step_cache(step_cache, x, text, inputs, signal, self._blocks, self._block_range)
        x = self.proj_out(self.norm_out(self.norm_final(x), emb))
        p = c.patch_size
        if c.patch_size_t is None:
            out = x.reshape(b, f, h // p, w // p, -1, p, p)
            return out.permute(0, 1, 4, 2, 5, 3, 6).flatten(5, 6).flatten(3, 4)
        pt = c.patch_size_t
        out = x.reshape(b, (f + pt - 1) // pt, h // p, w // p, -1, pt, p, p)
        return out.permute(0, 1, 5, 4, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(1, 2)

    def _blocks(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every block over these rows, on one device or over the sequence-parallel ranks."""
        split = sequence_split([text.shape[1], x.shape[1]])
        if split is None:
            return self._run_blocks(x, text, inputs)
        return self._run_blocks_split(split, x, text, inputs)

    def _block_range(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> SequentialBlocks:
        """The blocks as a `BlockRange` for DBCache: video and text streams, both updated by every block."""
        refuse_sequence_parallel(sequence_split([text.shape[1], x.shape[1]]), "CogVideoX")

        def call(i: int, x: torch.Tensor, text: torch.Tensor | None, rows: BlockInputs) -> tuple:
            return self.transformer_blocks[i](x, text, rows.emb, rows.rope)

        return SequentialBlocks(len(self.transformer_blocks), x, text, inputs.take, call)

    def _run_blocks(self, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Every block over the video and text tokens; the video tokens the output head reads."""
        for block in self.transformer_blocks:
            x, text = block(x, text, inputs.emb, inputs.rope)
        return x

    def _run_blocks_split(
        self, split: SequenceSplit, x: torch.Tensor, text: torch.Tensor, inputs: BlockInputs
    ) -> torch.Tensor:
        """`_run_blocks` with the text (stream 0) and video (stream 1) tokens split over the
        sequence-parallel ranks: the blocks concatenate the local [text; video] shards in the split's
        stream order, the scope masks the shards' padding, and the RoPE rows (video only) are cut with the
        video tokens. The video tokens are gathered back at the end."""
        text_stream, video = 0, 1
        rope = inputs.rope
        if rope is not None:
            rope = (split.split(video, rope[0], dim=0), split.split(video, rope[1], dim=0))
        x, text = split.split(video, x), split.split(text_stream, text)
        with split.attention_scope(x.shape[0], x.device):
            x = self._run_blocks(x, text, inputs._replace(rope=rope))
        return split.gather(video, x)


class _AdaLayerNormOut(nn.Module):
    """The head's adaptive LayerNorm: shift and scale (in that order) from Linear(SiLU(emb))."""

    def __init__(self, conditioning_dim: int, dim: int, affine: bool, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(conditioning_dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps, affine)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.linear(F.silu(emb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]
