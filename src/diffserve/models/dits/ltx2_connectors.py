"""LTX-2 text connectors, native, loading Diffusers `LTX2TextConnectors` weights (a Diffusers folder's
`connectors/`, `_class_name` "LTX2TextConnectors") unchanged.

They turn the stacked per-layer hidden states of the Gemma text encoder (batch, L, caption_channels,
layers) - or the same flattened to (batch, L, caption_channels * layers) - into the DiT's video and
audio text states:

1. feature extraction
   * LTX-2.0 (`per_modality_projections` False): per sample and layer, subtract the mean and divide by
     the range (max - min) over the valid tokens, times `scale_factor`; padding zeroed; one shared
     `text_proj_in` to caption_channels.
   * LTX-2.3+ (`per_modality_projections` True): RMS-normalise each token per layer, zero the padding,
     scale by sqrt(modality width / caption_channels), and project per modality (`video_text_proj_in`,
     `audio_text_proj_in`).
2. a small 1-D transformer per modality (`video_connector`, `audio_connector`): padding replaced by
   learned registers (valid tokens moved to the front in order, registers fill the rest by absolute
   position; the mask then allows every token), 1-D RoPE, pre-norm attention + GELU FFN blocks, final RMSNorm.
3. the video states are multiplied by a keep-mask derived from the connector's additive mask as
   `mask < 1e-6`. As in Diffusers this keeps every token: with registers the mask is all zero, and
   without them padded entries are -finfo.max, also below 1e-6. The returned (batch, L) mask - the
   DiT's `encoder_attention_mask` in the pipelines - is therefore all ones; it is computed, not assumed.

`forward` keeps Diffusers' arguments and returns its tuple (video states, audio states, mask (batch, L)
int64). Diffusers accepts `causal_temporal_positioning` and never reads it; so does this port.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from diffserve.layers.norms import RMSNorm
from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.dits.ltx2_blocks import LTX2Attention, LTX2FeedForward
from diffserve.models.dits.ltx2_rope import LTX2Rope, check_rope_type, connector_rope

CONNECTOR_EPS = 1e-6
PADDING_SIDES = ("left", "right")
#: Additive-mask entries at or above this count as valid tokens when registers replace the padding.
REGISTER_MASK_THRESHOLD = -9000.0


@dataclass(frozen=True)
class LTX2TextConnectorsConfig:
    """The connectors' Diffusers config (`connectors/config.json`), one field per key, Diffusers' defaults.

    LTX-2.0: 30 heads x 128 (= caption_channels 3840) and 2 layers per modality, no gating, shared
    bias-free projection. LTX-2.3: 32 x 128 video / 32 x 64 audio heads, 8 layers, gated attention,
    per-modality projections with bias to video_hidden_dim 4096 / audio_hidden_dim 2048.
    """

    caption_channels: int = 3840
    text_proj_in_factor: int = 49
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    def __post_init__(self) -> None:
        check_rope_type(self.rope_type)
        video_in = self.video_hidden_dim if self.per_modality_projections else self.caption_channels
        audio_in = self.audio_hidden_dim if self.per_modality_projections else self.caption_channels
        for name, width, heads, head_dim in (
            (
                "video",
                video_in,
                self.video_connector_num_attention_heads,
                self.video_connector_attention_head_dim,
            ),
            (
                "audio",
                audio_in,
                self.audio_connector_num_attention_heads,
                self.audio_connector_attention_head_dim,
            ),
        ):
            if heads * head_dim != width:
                source = f"{name}_hidden_dim" if self.per_modality_projections else "caption_channels"
                raise ValueError(
                    f"{name}_connector_num_attention_heads * {name}_connector_attention_head_dim "
                    f"({heads} x {head_dim}) must equal {source} ({width}), the width the projection feeds it"
                )


def per_layer_masked_mean_norm(
    states: torch.Tensor, lengths: torch.Tensor, padding_side: str, scale_factor: float, eps: float = 1e-6
) -> torch.Tensor:
    """LTX-2.0 features: (batch, L, C, layers) -> (batch, L, C * layers), each layer centred on the mean of
    its valid tokens and divided by their range, times `scale_factor`; padded tokens zero. Computed in the
    input dtype, as Diffusers does."""
    batch, seq_len, channels, layers = states.shape
    index = torch.arange(seq_len, device=states.device).unsqueeze(0)
    # Right padding: tokens first; left padding: tokens last.
    valid = index < lengths[:, None] if padding_side == "right" else index >= seq_len - lengths[:, None]
    valid = valid[:, :, None, None]
    count = (lengths * channels).view(batch, 1, 1, 1)
    mean = states.masked_fill(~valid, 0.0).sum(dim=(1, 2), keepdim=True) / (count + eps)
    low = states.masked_fill(~valid, float("inf")).amin(dim=(1, 2), keepdim=True)
    high = states.masked_fill(~valid, float("-inf")).amax(dim=(1, 2), keepdim=True)
    normed = ((states - mean) / (high - low + eps) * scale_factor).flatten(2)
    normed = normed.masked_fill(~valid.squeeze(-1).expand(-1, -1, channels * layers), 0.0)
    return normed.to(states.dtype)


def per_token_rms_norm(states: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LTX-2.3 features: each token of each layer (batch, L, C, layers) divided by its RMS over C."""
    variance = torch.mean(states**2, dim=2, keepdim=True)
    return states * torch.rsqrt(variance + eps)


class LTX2ConnectorBlock(nn.Module):
    """Pre-norm self-attention (1-D RoPE) and GELU FFN, ungated residuals (Diffusers' `LTX2TransformerBlock1d`)."""

    def __init__(self, dim: int, heads: int, head_dim: int, gated: bool) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, eps=CONNECTOR_EPS, elementwise_affine=False, round_once=True)
        self.attn1 = LTX2Attention(dim, heads, head_dim, gated=gated)
        self.norm2 = RMSNorm(dim, eps=CONNECTOR_EPS, elementwise_affine=False, round_once=True)
        self.ff = LTX2FeedForward(dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None, rope: LTX2Rope) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), attn_mask=attn_mask, query_rope=rope)
        return x + self.ff(self.norm2(x))


class LTX2ConnectorTransformer1d(nn.Module):
    """One modality's connector: registers, 1-D RoPE, blocks, final RMSNorm (Diffusers' names)."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        num_layers: int,
        num_learnable_registers: int | None,
        rope_base_seq_len: int,
        rope_theta: float,
        rope_double_precision: bool,
        rope_type: str,
        gated: bool,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.inner_dim = heads * head_dim
        self.num_learnable_registers = num_learnable_registers
        self.rope_base_seq_len = rope_base_seq_len
        self.rope_theta = rope_theta
        self.rope_double_precision = rope_double_precision
        self.rope_type = rope_type
        self.learnable_registers = (
            nn.Parameter(torch.zeros(num_learnable_registers, self.inner_dim))
            if num_learnable_registers is not None
            else None
        )
        self.transformer_blocks = nn.ModuleList(
            [LTX2ConnectorBlock(self.inner_dim, heads, head_dim, gated) for _ in range(num_layers)]
        )
        self.norm_out = RMSNorm(self.inner_dim, eps=CONNECTOR_EPS, elementwise_affine=False, round_once=True)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (batch, L, inner), additive mask (batch, 1, 1, L) -> states, the mask the blocks used."""
        batch, seq_len, _ = x.shape
        block_mask: torch.Tensor | None = attn_mask
        if self.learnable_registers is not None:
            x = self._fill_registers(x, attn_mask)
            attn_mask = torch.zeros_like(attn_mask)
            block_mask = None  # every token is valid now; an all-zero bias changes nothing
        rope = connector_rope(
            batch, seq_len, self.inner_dim, self.rope_base_seq_len, self.rope_theta,
            self.rope_double_precision, self.rope_type, self.heads, x.device,
        )  # fmt: skip
        for block in self.transformer_blocks:
            x = block(x, block_mask, rope)
        return self.norm_out(x), attn_mask

    def _fill_registers(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """Valid tokens moved to the front in order; the tail takes the registers at their absolute positions
        (the register table tiled over the sequence)."""
        batch, seq_len, width = x.shape
        count = self.num_learnable_registers
        if seq_len % count:
            raise ValueError(
                f"the text sequence length {seq_len} must be a multiple of the {count} learnable registers"
            )
        registers = (
            self.learnable_registers.unsqueeze(0).expand(seq_len // count, -1, -1).reshape(seq_len, -1)
        )
        valid = (attn_mask >= REGISTER_MASK_THRESHOLD).int().reshape(batch, seq_len)
        order = torch.argsort(1 - valid, dim=1, stable=True)
        front = torch.gather(x, 1, order.unsqueeze(-1).expand(-1, -1, width))
        kept = torch.arange(seq_len, device=x.device).unsqueeze(0) < valid.sum(dim=1, keepdim=True)
        return torch.where(
            kept.unsqueeze(-1), front, registers.unsqueeze(0).expand(batch, -1, -1).to(x.dtype)
        )


class LTX2TextConnectors(DiffusersConfigured, nn.Module):
    """Gemma per-layer states -> (video text states, audio text states, mask) for the LTX-2 DiT.

    Build from an `LTX2TextConnectorsConfig` (or `from_config(config_json_dict)`); meta-device construction
    and `load_state_dict(sd, assign=True, strict=True)` as for the DiTs.
    """

    diffusers_class_name: ClassVar[str] = "LTX2TextConnectors"
    config_class = LTX2TextConnectorsConfig

    def __init__(self, config: LTX2TextConnectorsConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        text_dim = c.caption_channels * c.text_proj_in_factor
        if c.per_modality_projections:
            self.video_text_proj_in = nn.Linear(text_dim, c.video_hidden_dim, bias=c.proj_bias)
            self.audio_text_proj_in = nn.Linear(text_dim, c.audio_hidden_dim, bias=c.proj_bias)
        else:
            self.text_proj_in = nn.Linear(text_dim, c.caption_channels, bias=c.proj_bias)
        rope = {
            "rope_base_seq_len": c.connector_rope_base_seq_len,
            "rope_theta": c.rope_theta,
            "rope_double_precision": c.rope_double_precision,
            "rope_type": c.rope_type,
        }
        self.video_connector = LTX2ConnectorTransformer1d(
            c.video_connector_num_attention_heads, c.video_connector_attention_head_dim,
            c.video_connector_num_layers, c.video_connector_num_learnable_registers, gated=c.video_gated_attn, **rope,
        )  # fmt: skip
        self.audio_connector = LTX2ConnectorTransformer1d(
            c.audio_connector_num_attention_heads, c.audio_connector_attention_head_dim,
            c.audio_connector_num_layers, c.audio_connector_num_learnable_registers, gated=c.audio_gated_attn, **rope,
        )  # fmt: skip

    def forward(
        self,
        text_encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        padding_side: str = "left",
        scale_factor: int = 8,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Video and audio text states for the DiT.

        Args:
            text_encoder_hidden_states: (batch, L, caption_channels, layers), or flattened
                (batch, L, caption_channels * layers) channel-major as the pipelines stack them.
            attention_mask: (batch, L), 1 for tokens, 0 for padding.
            padding_side: where the tokenizer padded ("left" for Gemma); LTX-2.0 features only.
            scale_factor: LTX-2.0 feature scale.

        Returns:
            (video states (batch, L, video width), audio states (batch, L, audio width), mask (batch, L) int64
            for the DiT's `encoder_attention_mask`; all ones, see the module docstring).
        """
        c = self.config
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
        states = text_encoder_hidden_states
        if states.ndim == 3:
            states = states.unflatten(2, (c.caption_channels, -1))
        if states.ndim != 4 or states.shape[2:] != (c.caption_channels, c.text_proj_in_factor):
            raise ValueError(
                f"text_encoder_hidden_states must be (batch, L, {c.caption_channels}, {c.text_proj_in_factor}) "
                f"or flattened, got {tuple(text_encoder_hidden_states.shape)}"
            )

        if c.per_modality_projections:
            normed = per_token_rms_norm(states).flatten(2, 3)
            normed = torch.where(attention_mask.bool().unsqueeze(-1), normed, torch.zeros_like(normed))
            video_in = self.video_text_proj_in(normed * math.sqrt(c.video_hidden_dim / c.caption_channels))
            audio_in = self.audio_text_proj_in(normed * math.sqrt(c.audio_hidden_dim / c.caption_channels))
        else:
            lengths = attention_mask.sum(dim=-1)
            video_in = audio_in = self.text_proj_in(
                per_layer_masked_mean_norm(states, lengths, padding_side, scale_factor)
            )

        dtype = video_in.dtype
        additive = (attention_mask.to(torch.int64) - 1).to(dtype).reshape(attention_mask.shape[0], 1, 1, -1)
        additive = additive * torch.finfo(dtype).max
        video, video_mask = self.video_connector(video_in, additive)
        keep = (video_mask < 1e-6).to(torch.int64).reshape(video.shape[0], video.shape[1], 1)
        video = video * keep
        audio, _ = self.audio_connector(audio_in, additive)
        return video, audio, keep.squeeze(-1)
