"""HunyuanImage 2.1 image transformer (Tencent Hunyuan), native, loading Diffusers
`HunyuanImageTransformer2DModel` weights unchanged.

Architecture (MMDiT over 2-D latent patches: double-stream blocks, then single-stream blocks):

    x    = x_embedder(latents)                      Conv2d, stride = patch (1 x 1 for the released DiTs)
    temb = MLP(sinusoids(t)) [(+ MLP_r(sinusoids(t_r))) / 2, MeanFlow] [+ MLP_g(sinusoids(guidance))]
    ctx  = [ByT5 glyph states -> LN + GELU MLP ; Qwen2.5-VL states -> token refiner]
           each row's valid tokens first (glyph, then text), padding after (and masked as keys)
    num_layers x double block:        adaLN-Zero per stream, joint attention over [image; ctx]
    num_single_layers x single block: one adaLN-Zero over [image; ctx], attention and tanh-GELU MLP in
                                      parallel, one output projection
    out  = unpatchify(proj_out(adaLN(x, temb)))                         (batch, out_channels, H, W)

The pieces are the Hunyuan video models' (same maths and weight names): the double-stream block and the
ByT5 projection are HunyuanVideo 1.5's, the single-stream block and the token refiner (its Diffusers mask:
valid queries see valid keys, every query sees token 0) HunyuanVideo 1.0's. What is this model's own is
here: the 2-D patch embedding and RoPE, the time / MeanFlow / guidance embedding, and the forward.

RoPE: the head dimension is split into (row, column) slices of `rope_axes_dim` channels; token (h, w)
rotates channel pair `i` of an axis slice by `pos_axis * rope_theta ** (-2i / axis_dim)`, pairs
interleaved, angles in float32 as in Diffusers; image queries and keys only. Tables are cached per grid.

Context: Diffusers reorders each row to [valid glyph, valid text, padded glyph, padded text] and masks the
padded tokens as keys in every block (queries are not masked: a padded text token's own value never
reaches the image tokens). Here the padding is cut after the longest row's valid tokens (the same output,
a shorter attention; a batch of one request runs without a mask). The cut reads the row lengths on the
host (one sync per forward).

Differences from Diffusers' forward that do not change the numbers for the inputs its pipeline passes:
- Only 2-D patches (`patch_size` of two entries, the released DiTs'); a 3-entry (video) patch is refused.
- Latents whose size is not a multiple of the patch size are rejected, not cropped.
- `forward` returns the sample tensor itself (Diffusers' `return_dict=False` gives `(sample,)`).
- `qk_norm` other than "rms_norm" (the released checkpoints' value) is rejected.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`), as HunyuanVideo's: the image
tokens (with their RoPE rows) and the packed context tokens are two streams, each split over the
sequence-parallel ranks; every block's joint attention runs over the local [image; context] shards with
`sequence_attention`, the context's padding mask and the shards' padding masked, and the image tokens are
gathered before the output head. The token refiner and the glyph projection run whole on every rank (the
refiner's (txt, txt) mask masks queries too, and the text is short). With one sequence-parallel rank
nothing changes.

Step cache (`models/step_cache.py`, the cache methods by name): the whole-span methods reuse the residual
of every block; DBCache runs the blocks in ranges (`SequentialBlocks`), counted as for FLUX: the
double-stream blocks, then the single-stream ones (both update the image and the context streams).
Block-range methods are refused under sequence parallelism.

Not implemented (refused at load or by the engine): tensor parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import sequence_split
from diffserve.layers.adaln import AdaLayerNormContinuous
from diffserve.layers.embeddings import TimestepEmbedding
from diffserve.layers.rotary import RopeTables, checked_rope_axes, grid_rope_tables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.hunyuan_shared import (
    JointBlockInputs,
    block_range,
    joint_key_mask,
    run_blocks_split,
)
from diffserve.models.dits.hunyuan_video import HunyuanVideoSingleTransformerBlock, HunyuanVideoTokenRefiner
from diffserve.models.dits.hunyuan_video15 import (
    HunyuanVideo15TransformerBlock,
    check_tokens,
    pack_context,
    timestep_rows,
)
from diffserve.models.dits.hunyuan_video15_embedders import (
    BYT5_PROJECTION_HIDDEN,
    TIMESTEP_CHANNELS,
    HunyuanVideo15ByT5TextProjection,
    timestep_embedding,
)
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows

NORM_EPS = 1e-6
#: RoPE tables kept per (grid, device); a server sees a handful of image sizes.
ROPE_CACHE_SIZE = 16


@dataclass(frozen=True)
class HunyuanImageTransformerConfig(DiTConfig):
    """The HunyuanImage 2.1 DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are Diffusers' (the 17B base and distilled checkpoints: 28 heads x 128, 20 + 40 layers,
    64 latent channels, 1x1 patches). `out_channels` None means `in_channels`; sequences become tuples.
    """

    in_channels: int = 64
    out_channels: int | None = 64
    num_attention_heads: int = 28
    attention_head_dim: int = 128
    num_layers: int = 20
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: tuple[int, ...] = (1, 1)
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = False
    text_embed_dim: int = 3584
    text_embed_2_dim: int | None = None
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (64, 64)
    use_meanflow: bool = False

    def __post_init__(self) -> None:
        if self.qk_norm != "rms_norm":
            raise ValueError(f"qk_norm {self.qk_norm!r} is not supported; HunyuanImage 2.1 uses 'rms_norm'")
        patch = tuple(int(p) for p in self.patch_size)
        if len(patch) != 2:
            raise ValueError(
                f"patch_size {patch} is not supported: diffserve's HunyuanImage DiT takes 2-D patches "
                "(height, width), as the released text-to-image checkpoints"
            )
        rope_axes_dim = checked_rope_axes("rope_axes_dim", self.rope_axes_dim, self.attention_head_dim, 2)
        self._normalise(
            patch_size=patch, rope_axes_dim=rope_axes_dim, out_channels=self.out_channels or self.in_channels
        )


def hunyuan_image_rope_tables(
    height: int, width: int, axes_dims: tuple[int, ...], theta: float, device: torch.device
) -> RopeTables:
    """Half-width float32 (cos, sin) tables (height*width, head_dim // 2) for a post-patch grid, in the
    flattened patch order (row, column); angles in float32, as Diffusers computes them."""
    return grid_rope_tables((height, width), axes_dims, theta, device)


class HunyuanImagePatchEmbed(nn.Module):
    """Latents (batch, C, H, W) -> patch tokens (batch, H'*W', inner) in (row, column) order."""

    def __init__(self, in_channels: int, dim: int, patch: tuple[int, int]) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch, stride=patch)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.proj(latents).flatten(2).transpose(1, 2)


class HunyuanImageTimeGuidanceEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)); MeanFlow checkpoints average it with MLP_r(sinusoids(t_r)); guidance-
    distilled ones add MLP_g(sinusoids(guidance)). Every sinusoid is rounded to the timestep's dtype, as in
    Diffusers (`time_guidance_embed`)."""

    def __init__(self, embedding_dim: int, guidance_embeds: bool, use_meanflow: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, embedding_dim)
        self.timestep_embedder_r = (
            TimestepEmbedding(TIMESTEP_CHANNELS, embedding_dim) if use_meanflow else None
        )
        self.guidance_embedder = (
            TimestepEmbedding(TIMESTEP_CHANNELS, embedding_dim) if guidance_embeds else None
        )

    def forward(
        self, timestep: torch.Tensor, timestep_r: torch.Tensor | None, guidance: torch.Tensor | None
    ) -> torch.Tensor:
        dtype = timestep.dtype
        emb = timestep_embedding(self.timestep_embedder, timestep, dtype)
        if timestep_r is not None:
            if self.timestep_embedder_r is None:
                raise ValueError("timestep_r is only for MeanFlow models (use_meanflow=True); pass None")
            emb = (emb + timestep_embedding(self.timestep_embedder_r, timestep_r, dtype)) / 2
        if self.guidance_embedder is None:
            return emb
        if guidance is None:
            raise ValueError("this model embeds the guidance scale (guidance_embeds=True): pass `guidance`")
        return emb + timestep_embedding(self.guidance_embedder, guidance, dtype)


class HunyuanImageTransformer2DModel(DiffusersDiT):
    """HunyuanImage 2.1 DiT (base, guidance-distilled, MeanFlow) with Diffusers' config keys and
    state-dict names.

    Built from a `HunyuanImageTransformerConfig` (`DiffusersDiT`). It holds no buffers; RoPE tables are
    built on first use per latent grid and cached.
    """

    diffusers_class_name: ClassVar[str] = "HunyuanImageTransformer2DModel"
    config_class = HunyuanImageTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: HunyuanImageTransformerConfig) -> None:
        super().__init__(config)
        inner, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache(ROPE_CACHE_SIZE)

        self.x_embedder = HunyuanImagePatchEmbed(config.in_channels, inner, config.patch_size)
        self.context_embedder = HunyuanVideoTokenRefiner(
            config.text_embed_dim, heads, head_dim, config.num_refiner_layers
        )
        self.context_embedder_2 = (
            HunyuanVideo15ByT5TextProjection(config.text_embed_2_dim, BYT5_PROJECTION_HIDDEN, inner)
            if config.text_embed_2_dim is not None
            else None
        )
        self.time_guidance_embed = HunyuanImageTimeGuidanceEmbedding(
            inner, config.guidance_embeds, config.use_meanflow
        )
        self.transformer_blocks = nn.ModuleList(
            [
                HunyuanVideo15TransformerBlock(heads, head_dim, config.mlp_ratio)
                for _ in range(config.num_layers)
            ]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [
                HunyuanVideoSingleTransformerBlock(heads, head_dim, config.mlp_ratio)
                for _ in range(config.num_single_layers)
            ]
        )
        self.norm_out = AdaLayerNormContinuous(inner, eps=NORM_EPS)
        self.proj_out = nn.Linear(inner, math.prod(config.patch_size) * config.out_channels)

    def rope_tables(self, height: int, width: int, device: torch.device) -> RopeTables:
        """Half-width (cos, sin) float32 tables for a post-patch grid, cached per grid and device."""
        return self._rope_cache.get_or_build(
            (height, width),
            device,
            lambda: hunyuan_image_rope_tables(
                height, width, self.config.rope_axes_dim, self.config.rope_theta, device
            ),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        timestep_r: torch.Tensor | None = None,
        encoder_hidden_states_2: torch.Tensor | None = None,
        encoder_attention_mask_2: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        attention_kwargs: Mapping[str, Any] | None = None,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for image latents (Diffusers' keyword arguments).

        Args:
            hidden_states: (batch, in_channels, height, width) noisy latents.
            timestep: (batch,) or (1,) scheduler timesteps in [0, 1000], one per row (rows may be at
                different steps); a floating timestep's dtype rounds the sinusoids, as in Diffusers.
            encoder_hidden_states: Qwen2.5-VL states (batch, txt, text_embed_dim).
            encoder_attention_mask: (batch, txt) bool/int, nonzero for real tokens (right-padded).
            timestep_r: MeanFlow models only: the next step's timesteps, like `timestep`.
            encoder_hidden_states_2: ByT5 glyph states (batch, glyph, text_embed_2_dim); None (or a DiT
                without `text_embed_2_dim`): no glyph tokens.
            encoder_attention_mask_2: (batch, glyph) mask of the glyph tokens (all zero without quoted text).
            guidance: (batch,) embedded guidance (the distilled guidance scale * 1000); required exactly
                when the config has `guidance_embeds`.
            attention_kwargs: accepted for call compatibility; must be None or empty.
            step_cache: rows of requests with a cache method, which may reuse the blocks' residual from an
                earlier step (`models/step_cache.py`); None runs every block for every row (exact).

        Returns:
            The velocity (batch, out_channels, height, width) in the activations' dtype.
        """
        if attention_kwargs:
            raise ValueError(
                f"attention_kwargs {sorted(attention_kwargs)} are not supported; pass None (LoRA is applied at load)"
            )
        if hidden_states.ndim != 4:
            raise ValueError(
                f"hidden_states must be (batch, channels, height, width), got {tuple(hidden_states.shape)}"
            )
        batch, _, height, width = hidden_states.shape
        p_h, p_w = self.config.patch_size
        if height % p_h or width % p_w:
            raise ValueError(f"latent size {height}x{width} is not a multiple of the patch {p_h}x{p_w}")
        grid = (height // p_h, width // p_w)
        timestep = timestep_rows("timestep", timestep, batch)
        timestep_r = None if timestep_r is None else timestep_rows("timestep_r", timestep_r, batch)
        guidance = None if guidance is None else timestep_rows("guidance", guidance, batch)
        check_tokens("encoder_hidden_states", encoder_hidden_states, encoder_attention_mask, batch)

        rope = self.rope_tables(*grid, hidden_states.device)
        temb = self.time_guidance_embed(timestep, timestep_r, guidance)
        x = self.x_embedder(hidden_states)
        text_mask = encoder_attention_mask.bool()
        segments = [(self.context_embedder(encoder_hidden_states, timestep, text_mask), text_mask)]
        if self.context_embedder_2 is not None and encoder_hidden_states_2 is not None:
            check_tokens("encoder_hidden_states_2", encoder_hidden_states_2, encoder_attention_mask_2, batch)
            glyphs = self.context_embedder_2(encoder_hidden_states_2)
            segments.insert(0, (glyphs, encoder_attention_mask_2.bool()))
        context = pack_context(segments)
        ctx = context.states
        temb_act = F.silu(temb)
        inputs = JointBlockInputs(temb_act, rope, joint_key_mask(context.mask, x.shape[1]))
        blocks = self._block_list()

        def block_ranges() -> SequentialBlocks:
            refuse_sequence_parallel(sequence_split([x.shape[1], ctx.shape[1]]), "HunyuanImage 2.1")
            return block_range(blocks, x, ctx, inputs)

        x = run_with_step_cache(
            step_cache,
            x,
            lambda: self._first_block(x, temb_act),
            lambda rows: run_blocks_split(
                blocks, take_rows(x, rows), take_rows(ctx, rows), inputs.take(rows)
            ),
            block_ranges,
        )

        x = self.proj_out(self.norm_out(x, temb_act))
        # (batch, H', W', C, p_h, p_w) -> (batch, C, H'*p_h, W'*p_w)
        x = x.reshape(batch, *grid, -1, p_h, p_w).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(batch, -1, height, width)

    def _block_list(self) -> list[nn.Module]:
        """The blocks in the order they run (and the cache methods count them)."""
        return [*self.transformer_blocks, *self.single_transformer_blocks]

    def _first_block(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        """The first block's timestep-modulated image input: what the step cache watches change."""
        first = self._block_list()[0]
        norm = first.norm1 if isinstance(first, HunyuanVideo15TransformerBlock) else first.norm
        return norm(x, temb_act)[0]
