"""HunyuanVideo (1.0) video transformer (Tencent Hunyuan), native, loading Diffusers
`HunyuanVideoTransformer3DModel` weights unchanged.

Architecture (MMDiT over spatio-temporal patches: double-stream blocks, then single-stream blocks):

    x    = x_embedder(latents)                 Conv3d, stride = patch (patch_size_t, patch_size, patch_size)
    temb = MLP(sinusoids(t)) [+ MLP(sinusoids(guidance))] + MLP(CLIP pooled text)        (batch, inner)
    ctx  = token refiner(Llama states, t, mask)                                        (batch, txt, inner)
    num_layers x double block:        adaLN-Zero per stream, joint attention over [video; ctx]
    num_single_layers x single block: one adaLN-Zero over [video; ctx], attention and tanh-GELU MLP in
                                      parallel, one output projection
    out  = unpatchify(proj_out(adaLN(x, temb)))                          (batch, out_channels, F, H, W)

RoPE rotates the video queries and keys only (per-head RMSNorm on q and k first), with the same
(frame, row, column) tables as HunyuanVideo 1.5 (`hunyuan_video15_rope_tables`). The double-stream block
and the token refiner's layers are HunyuanVideo 1.5's (same maths and weight names); what differs is here:
the single-stream blocks (`hunyuan_video_single_block.py`), the guidance embedding and the refiner's mask.

Image-to-video DiTs (`image_condition_type`, Diffusers' `HunyuanVideoImageToVideoPipeline`):
"latent_concat" reads the pipeline's channel concat [noisy latents; image latents; mask] (in_channels
2C + 1) with the plain blocks; "token_replace" reads the image's latents as the first latent frame and
modulates that frame's tokens at timestep 0 (`hunyuan_video_token_replace.py`).

Text mask. Diffusers masks, in every block, the context keys at positions >= the row's count of valid
tokens (it assumes right padding); the refiner's self-attention masks query and key rows by the mask
itself, always letting every query see token 0. Both are kept: the refiner runs the full (txt, txt) mask,
and the blocks' key mask is built from the counts. Keys past the longest row's count are masked in every
row, so the context is cut there (the same output, a shorter attention; a batch whose rows all count the
same runs without a mask). The cut reads the counts on the host (one sync per forward).

Differences from Diffusers' forward that do not change the numbers for the inputs its pipeline passes:
- Latents whose frame or spatial size is not a multiple of the patch size are rejected, not cropped.
- `forward` returns the sample tensor itself (Diffusers' `return_dict=False` gives `(sample,)`).
- `qk_norm` other than "rms_norm" (the released checkpoints' value) is rejected.

Sequence parallelism (Ulysses, Ring, USP; `distributed/sequence_split.py`): the video tokens (with their
RoPE rows) and the cut context tokens are two streams, each split over the sequence-parallel ranks; every
block's joint attention runs over the local [video; context] shards with `sequence_attention`, the text
mask (the counts' key mask) and the shards' padding masked, and the video tokens are gathered before the
output head. The token refiner runs whole on every rank (its (txt, txt) mask masks queries too, and the
text is short). "token_replace" splits too: the first frame is the leading video tokens, so each rank
modulates the first-frame tokens its shard holds (`hunyuan_shared.run_blocks_split`). With one
sequence-parallel rank nothing changes.

Cache methods (`models/step_cache.py`, issue 33): the cached span is every block, from the patch
embedding's tokens to the video tokens `norm_out` reads; the watched signal is the first double-stream
block's modulated video input. DBCache counts the double-stream blocks, then the single-stream ones (as
cache-dit's HunyuanVideo adapter lists them) and runs them in ranges on (video, context) streams; it is
refused under a sequence split (`refuse_sequence_parallel`), the whole-span methods run there.

Not implemented yet: tensor parallelism (the model is refused for it).
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
from diffserve.layers.embeddings import CombinedTimestepTextEmbedding
from diffserve.layers.patches import video_patch_grid
from diffserve.models.cache_methods.blocks import SequentialBlocks, refuse_sequence_parallel
from diffserve.models.dits.base import DiTConfig
from diffserve.models.dits.hunyuan_shared import (
    FirstFrame,
    JointBlockInputs,
    block_range,
    joint_key_mask,
    run_blocks_split,
)
from diffserve.models.dits.hunyuan_video15 import (
    HunyuanVideo15PatchEmbed,
    HunyuanVideo15TransformerBlock,
    HunyuanVideoGridDiT,
    VideoGridConfig,
    check_tokens,
    normalise_grid_config,
    refuse_attention_kwargs,
    timestep_rows,
)
from diffserve.models.dits.hunyuan_video15_embedders import HunyuanVideo15TokenRefiner
from diffserve.models.dits.hunyuan_video_single_block import (
    NORM_EPS,
    AdaLayerNormZeroSingle,
    HunyuanVideoSelfAttention,
    HunyuanVideoSingleTransformerBlock,
)
from diffserve.models.dits.hunyuan_video_token_replace import (
    HunyuanVideoTokenReplaceSingleTransformerBlock,
    HunyuanVideoTokenReplaceTransformerBlock,
    first_frame_temb,
)
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows

__all__ = [
    "AdaLayerNormZeroSingle",
    "HunyuanVideoSelfAttention",
    "HunyuanVideoSingleTransformerBlock",
    "HunyuanVideoTokenRefiner",
    "HunyuanVideoTransformer3DModel",
    "HunyuanVideoTransformerConfig",
]

#: Diffusers' `image_condition_type` values: how an image-to-video DiT reads the input image's latents.
IMAGE_CONDITION_TYPES = ("latent_concat", "token_replace")


@dataclass(frozen=True)
class HunyuanVideoTransformerConfig(VideoGridConfig, DiTConfig):
    """The HunyuanVideo DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are Diffusers' (the released 13B text-to-video model: 24 heads x 128, 20 double and 40
    single blocks, guidance-distilled). `out_channels` None means `in_channels`; `rope_axes_dim` becomes
    a tuple.
    """

    in_channels: int = 16
    out_channels: int | None = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    image_condition_type: str | None = None

    def __post_init__(self) -> None:
        if self.image_condition_type not in (None, *IMAGE_CONDITION_TYPES):
            raise ValueError(
                f"image_condition_type {self.image_condition_type!r} is not a HunyuanVideo one: None "
                f"(text-to-video) or one of {IMAGE_CONDITION_TYPES} (image-to-video)"
            )
        normalise_grid_config(self, "HunyuanVideo")

    @property
    def token_replace(self) -> bool:
        """Whether the first latent frame's tokens are modulated at timestep 0 (`token_replace`)."""
        return self.image_condition_type == "token_replace"


class HunyuanVideoTokenRefiner(HunyuanVideo15TokenRefiner):
    """The Llama states' refiner (`context_embedder`), with Diffusers' HunyuanVideo mask: a query row of a
    valid token sees the valid keys, a padded one sees nothing but it; both always see token 0."""

    def forward(self, states: torch.Tensor, timestep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`mask` (batch, txt) bool, true for real tokens."""
        weights = mask.float().unsqueeze(-1)
        pooled = ((states * weights).sum(dim=1) / weights.sum(dim=1)).to(states.dtype)
        temb = self.time_text_embed(timestep, pooled)
        pairs = mask[:, None, :, None] & mask[:, None, None, :]
        pairs[..., 0] = True
        return self.token_refiner(self.proj_in(states), temb, pairs)


class HunyuanVideoTransformer3DModel(HunyuanVideoGridDiT):
    """HunyuanVideo text-to-video and image-to-video DiT with Diffusers' config keys and state-dict names.

    Built from a `HunyuanVideoTransformerConfig` (`DiffusersDiT`). It holds no buffers; RoPE tables are
    built on first use per latent grid and cached (`HunyuanVideoGridDiT`, with 1.5's DiT).
    """

    diffusers_class_name: ClassVar[str] = "HunyuanVideoTransformer3DModel"
    config_class = HunyuanVideoTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: HunyuanVideoTransformerConfig) -> None:
        super().__init__(config)
        inner, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim

        self.x_embedder = HunyuanVideo15PatchEmbed(config.in_channels, inner, config.patch)
        self.context_embedder = HunyuanVideoTokenRefiner(
            config.text_embed_dim, heads, head_dim, config.num_refiner_layers
        )
        self.time_text_embed = CombinedTimestepTextEmbedding(
            inner, config.pooled_projection_dim, guidance_embeds=config.guidance_embeds
        )
        double, single = (
            (HunyuanVideoTokenReplaceTransformerBlock, HunyuanVideoTokenReplaceSingleTransformerBlock)
            if config.token_replace
            else (HunyuanVideo15TransformerBlock, HunyuanVideoSingleTransformerBlock)
        )
        self.transformer_blocks = nn.ModuleList(
            [double(heads, head_dim, config.mlp_ratio) for _ in range(config.num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [single(heads, head_dim, config.mlp_ratio) for _ in range(config.num_single_layers)]
        )
        self.norm_out = AdaLayerNormContinuous(inner, eps=NORM_EPS)
        self.proj_out = nn.Linear(inner, math.prod(config.patch) * config.out_channels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        pooled_projections: torch.Tensor,
        guidance: torch.Tensor | None = None,
        attention_kwargs: Mapping[str, Any] | None = None,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for video latents (Diffusers' keyword arguments).

        Args:
            hidden_states: (batch, in_channels, frames, height, width) noisy latents ("latent_concat":
                with the image latents and mask on channels; "token_replace": the image's latents as the
                first frame).
            timestep: (batch,) or (1,) scheduler timesteps in [0, 1000], one per row (rows may be at
                different steps).
            encoder_hidden_states: Llama states (batch, txt, text_embed_dim).
            encoder_attention_mask: (batch, txt) bool / int / float, nonzero for real tokens.
            pooled_projections: CLIP's pooled text (batch, pooled_projection_dim).
            guidance: (batch,) embedded guidance (the pipeline's guidance_scale * 1000); required exactly
                when the config has `guidance_embeds`.
            attention_kwargs: accepted for call compatibility; must be None or empty.
            step_cache: rows of requests with a cache method, which may reuse the blocks' residual from an
                earlier step (`models/step_cache.py`); None runs every block for every row (exact).

        Returns:
            The velocity (batch, out_channels, frames, height, width) in the activations' dtype.
        """
        refuse_attention_kwargs(attention_kwargs)
        grid = video_patch_grid(hidden_states, self.config.patch)
        batch = hidden_states.shape[0]
        timestep = timestep_rows("timestep", timestep, batch)
        if guidance is not None:
            guidance = timestep_rows("guidance", guidance, batch)
        check_tokens("encoder_hidden_states", encoder_hidden_states, encoder_attention_mask, batch)
        if pooled_projections.ndim != 2 or pooled_projections.shape[0] != batch:
            raise ValueError(
                f"pooled_projections must be (batch={batch}, dim), got {tuple(pooled_projections.shape)}"
            )

        rope = self.rope_tables(*grid, hidden_states.device)
        temb = self.time_text_embed(timestep, pooled_projections, guidance)
        x = self.x_embedder(hidden_states)
        text_mask = encoder_attention_mask.bool()
        ctx = self.context_embedder(encoder_hidden_states, timestep, text_mask)
        ctx, key_mask = _cut_context(ctx, encoder_attention_mask, x.shape[1])

        temb_act = F.silu(temb)
        # token_replace: the first latent frame's tokens are modulated by their own (timestep 0) temb.
        first = None
        if self.config.token_replace:
            first_act = F.silu(first_frame_temb(self.time_text_embed, timestep, pooled_projections))
            first = FirstFrame(grid[1] * grid[2], first_act)
        inputs = JointBlockInputs(temb_act, rope, key_mask, first)
        blocks = [*self.transformer_blocks, *self.single_transformer_blocks]

        def block_ranges() -> SequentialBlocks:
            refuse_sequence_parallel(sequence_split([x.shape[1], ctx.shape[1]]), "HunyuanVideo")
            return block_range(blocks, x, ctx, inputs)

        x = run_with_step_cache(
            step_cache,
            x,
            lambda: self.transformer_blocks[0].norm1(x, temb_act)[0],
            lambda rows: run_blocks_split(
                blocks, take_rows(x, rows), take_rows(ctx, rows), inputs.take(rows)
            ),
            blocks=block_ranges,
        )
        return self.unpatchify(self.proj_out(self.norm_out(x, temb_act)), grid, hidden_states.shape)


def _cut_context(
    ctx: torch.Tensor, mask: torch.Tensor, video_len: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The context cut after the longest row's count of valid tokens, and the (batch, 1, 1, video + ctx)
    key mask of Diffusers' (positions past a row's count masked), None when no row is masked."""
    counts = mask.sum(dim=1, dtype=torch.int)
    longest, shortest = (int(n) for n in torch.stack([counts.max(), counts.min()]).tolist())
    ctx = ctx[:, :longest]
    if shortest == longest:
        return ctx, None
    text_keys = torch.arange(longest, device=ctx.device)[None, :] < counts[:, None]
    return ctx, joint_key_mask(text_keys, video_len)
