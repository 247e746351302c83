"""HunyuanVideo 1.5 video transformer (Tencent Hunyuan), native, loading Diffusers
`HunyuanVideo15Transformer3DModel` weights unchanged.

Architecture (double-stream MMDiT over spatio-temporal patches, no single-stream blocks):

    x    = x_embedder(latents)            Conv3d, stride = patch (patch_size_t, patch_size, patch_size)
    temb = MLP(sinusoids(t)) [+ MLP_r(sinusoids(t_r)), MeanFlow]                     (batch, inner)
    ctx  = [image (SigLIP, I2V) ; glyph (ByT5) ; text (Qwen2.5-VL, token refiner)]  each + cond_type_embed
           the valid tokens of each row first, in that order; padding after (and masked)
    num_layers x block:   adaLN-Zero for video and context, joint attention over [video; ctx]
                          (RoPE on the video tokens only, per-head RMSNorm on q and k), tanh-GELU MLPs
    out  = unpatchify(proj_out(adaLN(x, temb)))                        (batch, out_channels, F, H, W)

The latent input is the pipeline's channel concat [noisy latents; condition latents; mask]
(`in_channels` = 65 = 32 + 32 + 1 for the released checkpoints); T2V passes zero condition latents.
The conditioning embedders live in `hunyuan_video15_embedders.py`.

RoPE: the head dimension is split into (frame, row, column) slices of `rope_axes_dim` channels; token
(f, h, w) rotates channel pair `i` of an axis slice by `pos_axis * rope_theta ** (-2i / axis_dim)`, pairs
interleaved, angles in float32 as in Diffusers. Tables are half width and cached per (grid, device).

Context tokens and masks: Diffusers reorders each row to [valid image, valid glyph, valid text, padding]
and masks padded tokens as queries and keys (a (seq, seq) mask per row). Padded tokens never reach the
video tokens (they are masked as keys in every block), so here they are masked as keys only and the
context is cut after the longest row's valid tokens: the output is the same, the attention shorter,
and a batch whose rows are all unpadded after the cut (any single request) runs without a mask, so
fused attention backends apply. The cut reads the row lengths on the host (one sync per forward).

Differences from Diffusers' forward that do not change the numbers for the inputs its pipelines pass:
- "Text-to-video" is decided per row (all of the row's `image_embeds` zero), not for the whole batch;
  Diffusers' pipelines never mix the two in a batch, a serving batch may.
- `image_embeds=None` means text-to-video (no image tokens), `encoder_hidden_states_2=None` (with its
  mask None) means no glyph tokens: the output of zeros with an all-zero mask (to rounding), less work.
- Latents whose frame or spatial size is not a multiple of the patch size are rejected, not cropped.
- `forward` returns the sample tensor itself (Diffusers' `return_dict=False` gives `(sample,)`).
- `qk_norm` other than "rms_norm" (the only value the released checkpoints use) is rejected.

Not implemented yet (left for later): sequence parallelism, tensor parallelism and the step cache; the
model runs whole on one device and ignores the sequence-split scope.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.distributed.sequence_split import sequence_attention
from diffserve.layers.adaln import AdaLayerNormContinuous, AdaLayerNormZero
from diffserve.layers.feedforward import FeedForward
from diffserve.layers.joint_attention import JointAttention
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.patches import video_patch_grid
from diffserve.layers.residual import attention_mlp_residuals
from diffserve.layers.rotary import RopeTables, RotaryEmbedding, checked_rope_axes, grid_rope_tables
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.hunyuan_shared import JointBlockInputs, block_range, joint_key_mask, run_blocks
from diffserve.models.dits.hunyuan_video15_embedders import (
    BYT5_PROJECTION_HIDDEN,
    HunyuanVideo15ByT5TextProjection,
    HunyuanVideo15ImageProjection,
    HunyuanVideo15TimeEmbedding,
    HunyuanVideo15TokenRefiner,
)
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache, take_rows

NORM_EPS = 1e-6
#: `cond_type_embed` rows: which encoder a context token came from.
TEXT_TYPE, GLYPH_TYPE, IMAGE_TYPE = 0, 1, 2
#: RoPE tables kept per (grid, device); a server sees a handful of video sizes.
ROPE_CACHE_SIZE = 16


class VideoGridConfig:
    """The latent-grid facts of a HunyuanVideo DiT's config (1.0's and 1.5's, both with these fields)."""

    in_channels: int
    out_channels: int | None
    attention_head_dim: int
    patch_size: int
    patch_size_t: int
    qk_norm: str
    rope_axes_dim: tuple[int, ...]

    @property
    def patch(self) -> tuple[int, int, int]:
        """(frames, height, width) patch size of the latent grid."""
        return self.patch_size_t, self.patch_size, self.patch_size


def normalise_grid_config(config: DiTConfig, model: str) -> None:
    """A HunyuanVideo DiT config's checks and normalisation (from its `__post_init__`): per-head RMSNorm on
    q and k (the only `qk_norm` the released checkpoints use), three RoPE axes (frame, row, column) as a
    tuple, and `out_channels` None resolved to `in_channels`."""
    if config.qk_norm != "rms_norm":
        raise ValueError(f"qk_norm {config.qk_norm!r} is not supported; {model} uses 'rms_norm'")
    rope_axes_dim = checked_rope_axes("rope_axes_dim", config.rope_axes_dim, config.attention_head_dim, 3)
    config._normalise(rope_axes_dim=rope_axes_dim, out_channels=config.out_channels or config.in_channels)


@dataclass(frozen=True)
class HunyuanVideo15TransformerConfig(VideoGridConfig, DiTConfig):
    """The HunyuanVideo 1.5 DiT's Diffusers config (`transformer/config.json`), one field per key.

    The defaults are Diffusers' (the 8.3B 480p/720p T2V and I2V checkpoints: 16 heads x 128, 54 layers).
    `target_size` and `task_type` are read by the pipeline, not the model. `out_channels` None means
    `in_channels` and is resolved when the config is built; `rope_axes_dim` becomes a tuple.
    """

    in_channels: int = 65
    out_channels: int | None = 32
    num_attention_heads: int = 16
    attention_head_dim: int = 128
    num_layers: int = 54
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 1
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    text_embed_dim: int = 3584
    text_embed_2_dim: int = 1472
    image_embed_dim: int = 1152
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    target_size: int = 640
    task_type: str = "i2v"
    use_meanflow: bool = False

    def __post_init__(self) -> None:
        normalise_grid_config(self, "HunyuanVideo 1.5")


def hunyuan_video15_rope_tables(
    frames: int, height: int, width: int, axes_dims: tuple[int, ...], theta: float, device: torch.device
) -> RopeTables:
    """Half-width float32 (cos, sin) tables (frames*height*width, head_dim // 2) for a post-patch grid, in
    the flattened patch order (frame, row, column); angles in float32, as Diffusers computes them."""
    return grid_rope_tables((frames, height, width), axes_dims, theta, device)


class HunyuanVideo15PatchEmbed(nn.Module):
    """Latents (batch, C, F, H, W) -> patch tokens (batch, F'*H'*W', inner) in (frame, row, column) order."""

    def __init__(self, in_channels: int, dim: int, patch: tuple[int, int, int]) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=patch, stride=patch)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.proj(latents).flatten(2).transpose(1, 2)


class HunyuanVideo15Attention(JointAttention):
    """Joint attention over [video; context]: per-stream projections and per-head RMSNorms (Diffusers'
    names), RoPE on the video queries and keys only, one key mask over the joint sequence."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__(dim, num_heads, head_dim, lambda: RMSNorm(head_dim, eps=NORM_EPS))
        self.rope = RotaryEmbedding()

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, rope: RopeTables, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video output, context output); `key_mask` (batch, 1, 1, video + context) or None (all keys)."""
        q, k, v = self.image_heads(x)
        q, k = self.rope(q, k, *rope)
        cq, ck, cv = self.text_heads(ctx)
        # Over every rank's tokens inside a sequence-split scope (HunyuanVideo 1.0 and HunyuanImage 2.1
        # open one; HunyuanVideo 1.5 does not); plain attention otherwise.
        out = sequence_attention(
            torch.cat([q, cq], 1), torch.cat([k, ck], 1), torch.cat([v, cv], 1), key_mask
        )
        x_out, ctx_out = out.flatten(2).split([x.shape[1], ctx.shape[1]], dim=1)
        return self.to_out[0](x_out), self.to_add_out(ctx_out)


class HunyuanVideo15TransformerBlock(nn.Module):
    """Double-stream block: video and context keep their own adaLN-Zero, MLPs and projections and
    attend jointly; both are modulated by the same per-sample temb."""

    def __init__(self, num_heads: int, head_dim: int, mlp_ratio: float) -> None:
        super().__init__()
        dim = num_heads * head_dim
        self.norm1 = AdaLayerNormZero(dim, eps=NORM_EPS)
        self.norm1_context = AdaLayerNormZero(dim, eps=NORM_EPS)
        self.attn = HunyuanVideo15Attention(dim, num_heads, head_dim)
        self.norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff = FeedForward(dim, int(dim * mlp_ratio))
        self.norm2_context = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff_context = FeedForward(dim, int(dim * mlp_ratio))
        self.modulate = Modulate()

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, inputs: JointBlockInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video, context) after the block."""
        # Each stream's adaLN gives its normalised input and (gate_msa, shift_mlp, scale_mlp, gate_mlp).
        norm_x, *x_mods = self.norm1(x, inputs.temb_act)
        norm_c, *ctx_mods = self.norm1_context(ctx, inputs.temb_act)
        attn_x, attn_c = self.attn(norm_x, norm_c, inputs.rope, inputs.key_mask)
        x = attention_mlp_residuals(x, attn_x, x_mods, self.norm2, self.ff, self.modulate)
        ctx = attention_mlp_residuals(
            ctx, attn_c, ctx_mods, self.norm2_context, self.ff_context, self.modulate
        )
        return x, ctx


class JointContext(NamedTuple):
    """The context tokens of a batch, each row's valid tokens first, cut after the longest row's."""

    states: torch.Tensor  # (batch, ctx, inner)
    mask: torch.Tensor | None  # (batch, ctx) bool, true for valid tokens; None when all are valid


def pack_context(segments: list[tuple[torch.Tensor, torch.Tensor]]) -> JointContext:
    """Concatenate (states, mask) segments and move each row's valid tokens to the front, keeping their
    order (segment by segment, then position); padding follows and is cut after the longest row.

    This is Diffusers' [valid image, valid glyph, valid text, padding] order when the segments come in
    that order. Reads the row lengths on the host (one device sync).
    """
    states = torch.cat([s for s, _ in segments], dim=1)
    mask = torch.cat([m for _, m in segments], dim=1)
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)
    lengths = mask.sum(dim=1)
    longest, shortest = (int(n) for n in torch.stack([lengths.max(), lengths.min()]).tolist())
    order = order[:, :longest]
    states = states.gather(1, order.unsqueeze(-1).expand(-1, -1, states.shape[-1]))
    if shortest == longest:
        return JointContext(states, None)
    mask = mask.gather(1, order)
    # Zero the padding kept for shorter rows, as Diffusers does: masked keys must still be finite (a
    # row without any text token has a NaN refiner embedding, and 0 * NaN would reach the video).
    return JointContext(states.masked_fill(~mask.unsqueeze(-1), 0), mask)


class HunyuanVideoGridDiT(DiffusersDiT):
    """What the HunyuanVideo DiTs (1.0's `HunyuanVideoTransformer3DModel` and 1.5's) do on their latent
    grid alike: RoPE tables cached per post-patch grid and device, Diffusers' `attention_kwargs` refused,
    and the output head's unpatchify. Their configs have `patch`, `rope_axes_dim` and `rope_theta`."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__(config)
        self._rope_cache: BoundedCache[RopeTables] = BoundedCache(ROPE_CACHE_SIZE)

    def rope_tables(self, frames: int, height: int, width: int, device: torch.device) -> RopeTables:
        """Half-width (cos, sin) float32 tables for a post-patch grid, cached per grid and device."""
        return self._rope_cache.get_or_build(
            (frames, height, width),
            device,
            lambda: hunyuan_video15_rope_tables(
                frames, height, width, self.config.rope_axes_dim, self.config.rope_theta, device
            ),
        )

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int], shape: torch.Size) -> torch.Tensor:
        """The output head's tokens (batch, F'*H'*W', C * p_t * p_h * p_w) as latents of the input's `shape`
        (batch, C, F'*p_t, H'*p_h, W'*p_w)."""
        batch, _, frames, height, width = shape
        p_t, p_h, p_w = self.config.patch
        x = x.reshape(batch, *grid, -1, p_t, p_h, p_w).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(batch, -1, frames, height, width)


def refuse_attention_kwargs(attention_kwargs: Mapping[str, Any] | None) -> None:
    """Diffusers' per-call `attention_kwargs` (LoRA scales): diffserve applies LoRA at load, so none."""
    if attention_kwargs:
        raise ValueError(
            f"attention_kwargs {sorted(attention_kwargs)} are not supported; pass None (LoRA is applied at load)"
        )


class HunyuanVideo15Transformer3DModel(HunyuanVideoGridDiT):
    """HunyuanVideo 1.5 DiT (T2V, I2V, MeanFlow-distilled) with Diffusers' config keys and state-dict names.

    Built from a `HunyuanVideo15TransformerConfig` (`DiffusersDiT`). It holds no buffers; RoPE tables are
    built on first use per latent grid and cached.
    """

    diffusers_class_name: ClassVar[str] = "HunyuanVideo15Transformer3DModel"
    config_class = HunyuanVideo15TransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: HunyuanVideo15TransformerConfig) -> None:
        super().__init__(config)
        inner, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim

        self.x_embedder = HunyuanVideo15PatchEmbed(config.in_channels, inner, config.patch)
        self.image_embedder = HunyuanVideo15ImageProjection(config.image_embed_dim, inner)
        self.context_embedder = HunyuanVideo15TokenRefiner(
            config.text_embed_dim, heads, head_dim, config.num_refiner_layers
        )
        self.context_embedder_2 = HunyuanVideo15ByT5TextProjection(
            config.text_embed_2_dim, BYT5_PROJECTION_HIDDEN, inner
        )
        self.time_embed = HunyuanVideo15TimeEmbedding(inner, config.use_meanflow)
        self.cond_type_embed = nn.Embedding(3, inner)
        self.transformer_blocks = nn.ModuleList(
            [
                HunyuanVideo15TransformerBlock(heads, head_dim, config.mlp_ratio)
                for _ in range(config.num_layers)
            ]
        )
        self.norm_out = AdaLayerNormContinuous(inner, eps=NORM_EPS)
        self.proj_out = nn.Linear(inner, math.prod(config.patch) * config.out_channels)

    def embed_context(
        self,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        encoder_hidden_states_2: torch.Tensor | None = None,
        encoder_attention_mask_2: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> JointContext:
        """The blocks' context tokens for (batch,) `timestep`: image, glyph and refined text tokens, each
        plus its `cond_type_embed` row, valid tokens first (`pack_context`). Arguments as in `forward`."""
        batch = encoder_hidden_states.shape[0]
        check_tokens("encoder_hidden_states", encoder_hidden_states, encoder_attention_mask, batch)
        text_mask = encoder_attention_mask.bool()
        text = self.context_embedder(encoder_hidden_states, timestep, text_mask)
        segments = [(text + self.cond_type_embed.weight[TEXT_TYPE], text_mask)]

        if (encoder_hidden_states_2 is None) != (encoder_attention_mask_2 is None):
            raise ValueError(
                "pass encoder_hidden_states_2 (ByT5 states) and encoder_attention_mask_2 together"
            )
        if encoder_hidden_states_2 is not None:
            check_tokens("encoder_hidden_states_2", encoder_hidden_states_2, encoder_attention_mask_2, batch)
            glyph = self.context_embedder_2(encoder_hidden_states_2) + self.cond_type_embed.weight[GLYPH_TYPE]
            segments.insert(0, (glyph, encoder_attention_mask_2.bool()))

        if image_embeds is not None:
            if image_embeds.ndim != 3 or image_embeds.shape[0] != batch:
                raise ValueError(
                    f"image_embeds must be (batch={batch}, tokens, image_embed_dim), got {tuple(image_embeds.shape)}"
                )
            # A row of zeros is text-to-video: its image tokens are padding (per row; see module docstring).
            image_rows = image_embeds.flatten(1).ne(0).any(dim=1)
            image = self.image_embedder(image_embeds) + self.cond_type_embed.weight[IMAGE_TYPE]
            segments.insert(0, (image, image_rows[:, None].expand(-1, image.shape[1])))
        return pack_context(segments)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        timestep_r: torch.Tensor | None = None,
        encoder_hidden_states_2: torch.Tensor | None = None,
        encoder_attention_mask_2: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        attention_kwargs: Mapping[str, Any] | None = None,
        step_cache: BatchStepCache | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for video latents (Diffusers' keyword arguments).

        Args:
            hidden_states: (batch, in_channels, frames, height, width), the pipeline's concat
                [noisy latents; condition latents; condition mask] (zeros for T2V).
            timestep: (batch,) or (1,) scheduler timesteps in [0, 1000], one per row (rows may be at
                different steps); a floating timestep's dtype rounds the sinusoids, as in Diffusers.
            encoder_hidden_states: Qwen2.5-VL states (batch, txt, text_embed_dim).
            encoder_attention_mask: (batch, txt) bool/int, true/nonzero for real tokens.
            timestep_r: MeanFlow models only (`use_meanflow`): the next step's timesteps, like `timestep`.
            encoder_hidden_states_2: ByT5 glyph states (batch, glyph, text_embed_2_dim); None: no glyphs.
            encoder_attention_mask_2: (batch, glyph) mask of the glyph tokens (all zero when the prompt
                has no quoted text); None exactly when `encoder_hidden_states_2` is.
            image_embeds: SigLIP states (batch, img, image_embed_dim) for I2V; a row of zeros (what the
                T2V pipeline passes) or None means no image.
            attention_kwargs: accepted for call compatibility; must be None or empty (LoRA scales are
                applied by diffserve's loader, not per call).
            step_cache: rows of requests with a cache method, which may reuse the blocks' residual from an
                earlier step (`models/step_cache.py`); None runs every block for every row (exact).

        Returns:
            The velocity (batch, out_channels, frames, height, width) in the activations' dtype; the
            tensor itself, not Diffusers' `(sample,)` tuple or output object.
        """
        refuse_attention_kwargs(attention_kwargs)
        grid = video_patch_grid(hidden_states, self.config.patch)
        batch = hidden_states.shape[0]
        timestep = timestep_rows("timestep", timestep, batch)
        if timestep_r is not None:
            timestep_r = timestep_rows("timestep_r", timestep_r, batch)

        temb = self.time_embed(timestep, timestep_r)
        context = self.embed_context(
            timestep,
            encoder_hidden_states,
            encoder_attention_mask,
            encoder_hidden_states_2,
            encoder_attention_mask_2,
            image_embeds,
        )
        rope = self.rope_tables(*grid, hidden_states.device)
        x = self.x_embedder(hidden_states)
        ctx = context.states
        temb_act = torch.nn.functional.silu(temb)
        inputs = JointBlockInputs(temb_act, rope, joint_key_mask(context.mask, x.shape[1]))
        blocks = self.transformer_blocks
        # One device only: the blocks run whole inside a sequence-split scope too (module docstring).
        x = run_with_step_cache(
            step_cache,
            x,
            lambda: blocks[0].norm1(x, temb_act)[0],
            lambda rows: run_blocks(blocks, take_rows(x, rows), take_rows(ctx, rows), inputs.take(rows)),
            blocks=lambda: block_range(blocks, x, ctx, inputs),
        )

        return self.unpatchify(self.proj_out(self.norm_out(x, temb_act)), grid, hidden_states.shape)


def check_tokens(name: str, states: torch.Tensor, mask: torch.Tensor | None, batch: int) -> None:
    """`states` (batch, seq, dim) with a (batch, seq) mask."""
    if states.ndim != 3 or states.shape[0] != batch:
        raise ValueError(f"{name} must be (batch={batch}, tokens, dim), got {tuple(states.shape)}")
    if mask is None or tuple(mask.shape) != tuple(states.shape[:2]):
        got = None if mask is None else tuple(mask.shape)
        raise ValueError(f"the mask of {name} must be {tuple(states.shape[:2])} (batch, tokens), got {got}")


def timestep_rows(name: str, timestep: torch.Tensor, batch: int) -> torch.Tensor:
    """Timesteps (or another per-row value: the guidance) as (batch,): one per row, or one for the whole batch."""
    if timestep.ndim == 0:
        timestep = timestep.reshape(1)
    if timestep.ndim == 1 and timestep.shape[0] in (1, batch):
        return timestep.expand(batch)
    raise ValueError(f"{name} must have shape ({batch},) or (1,), got {tuple(timestep.shape)}")
