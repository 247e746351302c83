"""SANA transformer (NVIDIA / MIT HAN Lab), native, loading Diffusers `SanaTransformer2DModel` weights unchanged.

Architecture (a linear-attention DiT on DC-AE f32c32 latents, SANA 1.0 / 1.5 / Sprint):

    x    = patch_embed(latents) [+ 2-D sincos positions, 2K/4K checkpoints only]   (batch, H*W, inner)
    ctx  = RMSNorm(GELU-MLP(Gemma-2 states))                                       (batch, L, inner)
    emb  = MLP(sinusoids(t)) [+ MLP(sinusoids(guidance)), SANA-Sprint]            (batch, inner)
    mods = Linear(SiLU(emb))                                  adaLN-single: one projection for all blocks
    num_layers x block:
        x += gate_msa * ReLU-linear-attention(adaLN(x))      self-attention, O(N) in the image tokens
        x += softmax cross-attention(x, ctx, text mask)       no norm, no gate (as PixArt)
        x += gate_mlp * GLUMBConv(adaLN(x) as an H x W map)   Mix-FFN: 1x1, depthwise 3x3, gated 1x1
    out  = proj_out(adaLN(x, emb)) unpatchified to (batch, out_channels, H, W)

Each block adds its learned `scale_shift_table` to the shared modulation vectors, which have one row
per sample, so one forward serves requests at different timesteps. SANA 1.5 and Sprint normalise q
and k with an RMSNorm across all heads (`qk_norm="rms_norm_across_heads"`), in both attentions.

Timestep convention: `forward(timestep=...)` embeds the values exactly as given, as Diffusers' model
does. Diffusers' `SanaPipeline` passes the scheduler's `t` (in [0, 1000]) times `config.timestep_scale`
(1.0 in released checkpoints); `SanaSprintPipeline` passes its SCM timestep sin(t)/(sin(t)+cos(t)) in
[0, 1] unscaled, with `guidance = guidance_scale * config.guidance_embeds_scale`. The callers apply
these scales; this module applies none.

Differences from Diffusers that do not change the numbers: the blocks and the output head share
the timestep embedding computed once per forward; text can be embedded once per request
(`embed_context`) instead of at every step.

What SANA-Video's DiT shares with this one (adaLN-single, the cross-attention, the block's modulated
residuals, the text conditioning, block loop and output head) is in `sana_blocks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.glumbconv import GLUMBConv
from diffserve.layers.norms import LayerNorm
from diffserve.layers.residual import fp16_clip
from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.dits.base import DiTConfig
from diffserve.models.dits.input_checks import check_one_text_input, check_per_sample
from diffserve.models.dits.sana_blocks import (
    LINEAR_ATTENTION_EPS,
    SUPPORTED_QK_NORMS,
    LinearAttentionWeights,
    SanaBlockBase,
    SanaDiTBase,
    check_text_cross_attention,
)
from diffserve.models.step_cache import BatchStepCache


@dataclass(frozen=True)
class SanaTransformerConfig(DiTConfig):
    """The SANA DiT's Diffusers config (`transformer/config.json`), one field per key.

    Defaults are Diffusers' (SANA 1.0 1.6B). `out_channels` None means `in_channels`. `dropout` is
    accepted and unused (inference only). `timestep_scale` and `guidance_embeds_scale` are read by the
    pipeline, not by the model (see the module docstring).
    """

    in_channels: int = 32
    out_channels: int | None = 32
    num_attention_heads: int = 70
    attention_head_dim: int = 32
    num_layers: int = 20
    num_cross_attention_heads: int | None = 20
    cross_attention_head_dim: int | None = 112
    cross_attention_dim: int | None = 2240
    caption_channels: int = 2304
    mlp_ratio: float = 2.5
    dropout: float = 0.0
    attention_bias: bool = False
    sample_size: int = 32
    patch_size: int = 1
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    interpolation_scale: float | None = None
    guidance_embeds: bool = False
    guidance_embeds_scale: float = 0.1
    qk_norm: str | None = None
    timestep_scale: float = 1.0

    def __post_init__(self) -> None:
        self._normalise(out_channels=self.out_channels or self.in_channels)
        if self.qk_norm not in SUPPORTED_QK_NORMS:
            raise ValueError(
                f"SanaTransformer2DModel: qk_norm={self.qk_norm!r} is not supported; "
                f"released SANA checkpoints use one of {SUPPORTED_QK_NORMS}"
            )
        check_text_cross_attention(self, "SanaTransformer2DModel")
        if self.interpolation_scale is not None and self.inner_dim % 4:
            raise ValueError(f"sincos positions need inner_dim divisible by 4, got {self.inner_dim}")

    @property
    def cross_inner_dim(self) -> int:
        """Cross-attention's q/k/v width."""
        return int(self.num_cross_attention_heads) * int(self.cross_attention_head_dim)


# ---------------------------------------------------------------------------------------- inputs


def sincos_positions(
    dim: int, height: int, width: int, base_size: int, interpolation_scale: float
) -> torch.Tensor:
    """(1, height * width, dim) float32 2-D sincos positions, PixArt's / Diffusers' `PatchEmbed` grid,
    computed on the CPU (in float64, which not every accelerator has) as Diffusers' buffer is.

    Token (i, j) (row-major) sits at (j, i) / (side / base_size) / interpolation_scale, i.e. positions
    are stretched so that every resolution spans `base_size` units. The first half of the channels
    encodes the column coordinate, the second half the row (Diffusers' order); each half is
    [sin, cos] of position x 10000^(-k / (dim / 4)), computed in float64.
    """
    rows = torch.arange(height, dtype=torch.float32) / (height / base_size) / interpolation_scale
    cols = torch.arange(width, dtype=torch.float32) / (width / base_size) / interpolation_scale
    quarter = dim // 4
    omega = torch.arange(quarter, dtype=torch.float64) / (dim / 4.0)
    omega = 1.0 / 10000**omega

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(pos.reshape(-1).to(torch.float64), omega)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    col_grid = cols[None, :].expand(height, width)
    row_grid = rows[:, None].expand(height, width)
    return torch.cat([encode(col_grid), encode(row_grid)], dim=1).float().unsqueeze(0)


class SanaPatchEmbed(nn.Module):
    """Patchify conv (`patch_embed.proj`) and, for checkpoints with `interpolation_scale`, sincos positions.

    The positions are computed for each latent size (and cached per size and device, in a bounded
    `BoundedCache`); they are not in the checkpoint (Diffusers keeps them in a non-persistent buffer for
    the square training size).
    """

    def __init__(
        self, in_channels: int, dim: int, patch_size: int, sample_size: int, interpolation_scale: float | None
    ) -> None:
        super().__init__()
        self.dim = dim
        self.base_size = sample_size // patch_size
        self.interpolation_scale = interpolation_scale
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self._positions: BoundedCache[torch.Tensor] = BoundedCache()

    def positions(self, height: int, width: int, device: torch.device) -> torch.Tensor | None:
        """(1, height * width, dim) float32 positions for a height x width token grid, or None (SANA 1K)."""
        if self.interpolation_scale is None:
            return None
        scale = self.interpolation_scale
        return self._positions.get_or_build(
            (height, width),
            device,
            lambda: sincos_positions(self.dim, height, width, self.base_size, scale).to(device),
        )

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """(batch, C, H, W) -> (batch, H/p * W/p, dim) tokens, row-major."""
        tokens = self.proj(latents)
        height, width = tokens.shape[-2:]
        tokens = tokens.flatten(2).transpose(1, 2)
        pos = self.positions(height, width, latents.device)
        if pos is None:
            return tokens
        # Added in float32, then rounded to the activation dtype, as Diffusers does.
        return (tokens + pos).to(tokens.dtype)


# ------------------------------------------------------------------------------------- attention


class SanaLinearAttention(LinearAttentionWeights):
    """Self-attention with a ReLU kernel: out_i = sum_j (q_i . k_j) v_j / sum_j (q_i . k_j), q, k = ReLU(.).

    Per head it forms [V; 1] K^T ((head_dim + 1) x head_dim), then that times Q, so the cost is linear in
    the number of tokens; the products run in float32 whatever the activation dtype, as in Diffusers.
    Heads are kept channels-first, (batch, heads, head_dim, tokens), and the output projection reads
    the result as a transposed view: that is Diffusers' layout, and a bf16 CPU matmul rounds a strided
    input differently from a contiguous one.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, dim) -> (batch, tokens, dim)."""
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        # (batch, heads, head_dim, tokens), float32.
        q, k, v = (t.transpose(1, 2).unflatten(1, (self.num_heads, -1)) for t in (q, k, v))
        q, k = F.relu(q).float(), F.relu(k).float()
        v = F.pad(v.float(), (0, 0, 0, 1), value=1.0)  # a row of ones: its output row is the normaliser
        out = (v @ k.transpose(-1, -2)) @ q  # (batch, heads, head_dim + 1, tokens)
        out = out[:, :, :-1] / (out[:, :, -1:] + LINEAR_ATTENTION_EPS)
        out = out.flatten(1, 2).transpose(1, 2).to(x.dtype)
        return fp16_clip(self.to_out[0](out))


# ---------------------------------------------------------------------------------------- blocks


class SanaTransformerBlock(SanaBlockBase):
    """Linear self-attention, cross-attention to the text, GLUMBConv; adaLN-single modulated."""

    def __init__(self, config: SanaTransformerConfig) -> None:
        super().__init__(config, SanaLinearAttention, lambda dim, mlp_ratio: GLUMBConv(dim, dim, mlp_ratio))
        # Learned per-block offsets of the six shared modulation vectors (filled by the checkpoint).
        self.scale_shift_table = nn.Parameter(torch.empty(6, self.dim))

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        mask_bias: torch.Tensor | None,
        modulation: torch.Tensor,
        height: int,
        width: int,
    ) -> torch.Tensor:
        """x (batch, height * width, dim); modulation (batch, 6 * dim), the shared adaLN-single projection."""

        def mix_ffn(h: torch.Tensor) -> torch.Tensor:  # on the tokens as a (batch, dim, height, width) map
            h = self.ff(h.unflatten(1, (height, width)).permute(0, 3, 1, 2))
            return h.flatten(2).transpose(1, 2)

        return self.modulated(self.attn1, mix_ffn, x, ctx, mask_bias, modulation)


class SanaTransformer2DModel(SanaDiTBase):
    """SANA DiT with Diffusers' config keys and state-dict names.

    Built from a `SanaTransformerConfig` (`DiffusersDiT`); no buffers: the optional sincos positions are
    computed per latent size.

        forward(hidden_states (B, in_channels, H, W) latents,
                encoder_hidden_states (B, L, caption_channels) Gemma-2 states, or None with context=,
                encoder_attention_mask (B, L) 1 = token / 0 = padding, or None (attend to every token),
                timestep (B,) or (1,) embedded as given: SanaPipeline's t in [0, 1000] x config.timestep_scale,
                guidance (B,) or (1,) for guidance_embeds (Sprint): scale x config.guidance_embeds_scale,
                context=embed_context(encoder_hidden_states) to embed the text once per request)
            -> (B, out_channels, H, W) prediction (flow velocity for SANA, TrigFlow output for Sprint).
    """

    diffusers_class_name: ClassVar[str] = "SanaTransformer2DModel"
    config_class = SanaTransformerConfig

    def __init__(self, config: SanaTransformerConfig) -> None:
        super().__init__(config)
        inner = config.inner_dim
        self.patch_embed = SanaPatchEmbed(
            config.in_channels, inner, config.patch_size, config.sample_size, config.interpolation_scale
        )
        self._build_shared_layers(config, SanaTransformerBlock)
        self.scale_shift_table = nn.Parameter(torch.empty(2, inner))
        self.norm_out = LayerNorm(inner, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(inner, config.patch_size * config.patch_size * int(config.out_channels))

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
        """Predict from latents (see the class docstring for the arguments).

        Args:
            hidden_states: latents (batch, in_channels, H, W); H and W multiples of patch_size.
            encoder_hidden_states: Gemma-2 states (batch, L, caption_channels), or None with `context`.
            encoder_attention_mask: (batch, L), 1 for tokens and 0 for padding, or None.
            timestep: (batch,) or (1,), embedded as given (Diffusers' convention; see the module docstring).
            guidance: (batch,) or (1,) for guidance-embedding (Sprint) checkpoints, else None.
            context: `embed_context(encoder_hidden_states)`, given instead of `encoder_hidden_states`.
            step_cache: rows of requests with a cache method, which may reuse the blocks' residual from an
                earlier step (`models/step_cache.py`); None runs every block for every row (exact).

        Returns:
            (batch, out_channels, H, W), in the activation dtype.
        """
        if hidden_states.ndim != 4:
            raise ValueError(
                f"hidden_states must be (batch, C, H, W) latents, got {tuple(hidden_states.shape)}"
            )
        batch, _, height, width = hidden_states.shape
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"latent size {height}x{width} is not a multiple of patch_size {p}")
        check_per_sample(batch, timestep=timestep, guidance=guidance)
        check_one_text_input(encoder_hidden_states, context, "Gemma-2 states")

        h, w = height // p, width // p
        tokens = self.patch_embed(hidden_states)
        x = self._predict_tokens(
            tokens,
            (h, w),
            step_cache,
            timestep,
            guidance,
            encoder_hidden_states,
            encoder_attention_mask,
            context,
        )
        # (batch, h*w, p*p*C) -> (batch, C, h*p, w*p)
        x = x.reshape(batch, h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(batch, -1, h * p, w * p)
