"""HunyuanVideo (1.0)'s single-stream block (Diffusers' `HunyuanVideoSingleTransformerBlock`, weight names
included): one adaLN-Zero over [video; context], attention (RoPE on the video tokens) and a tanh-GELU MLP in
parallel, one output projection. HunyuanImage 2.1's DiT reuses it.

Under a sequence split (HunyuanVideo 1.0's, HunyuanImage 2.1's), `x` and `ctx` are this rank's shards of
the two streams and the attention (`sequence_attention`) reaches every rank's keys; outside a split scope it
is plain attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.distributed.sequence_split import sequence_attention
from diffserve.layers.attention_reuse import ReusableAttention
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.residual import gated_residual
from diffserve.layers.rotary import RopeTables, RotaryEmbedding
from diffserve.models.dits.hunyuan_shared import JointBlockInputs

NORM_EPS = 1e-6


class HunyuanVideoSelfAttention(ReusableAttention):
    """The single-stream block's attention weights (Diffusers' `Attention(pre_only=True)`: no output
    projection) and its per-head RMSNorms; RoPE on the leading video tokens only."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = RMSNorm(head_dim, eps=NORM_EPS)
        self.norm_k = RMSNorm(head_dim, eps=NORM_EPS)
        self.rope = RotaryEmbedding()

    def forward(
        self, h: torch.Tensor, video_len: int, rope: RopeTables, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention over [video; ctx] `h` (batch, seq, dim); returns (batch, seq, inner)."""
        q, k, v = (proj(h).unflatten(-1, (-1, self.head_dim)) for proj in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        q_video, k_video = self.rope(q[:, :video_len], k[:, :video_len], *rope)
        q = torch.cat([q_video, q[:, video_len:]], dim=1)
        k = torch.cat([k_video, k[:, video_len:]], dim=1)
        # Over every rank's tokens inside a sequence-split scope (HunyuanVideo 1.0's, HunyuanImage 2.1's);
        # plain attention otherwise.
        return sequence_attention(q, k, v, key_mask).flatten(2)


class HunyuanVideoSingleTransformerBlock(nn.Module):
    """Single-stream block on [video; ctx]: h + gate * proj_out([attention(x); GELU_tanh(proj_mlp(x))]),
    x the adaLN-Zero-modulated h."""

    def __init__(self, num_heads: int, head_dim: int, mlp_ratio: float) -> None:
        super().__init__()
        dim = num_heads * head_dim
        mlp_dim = int(dim * mlp_ratio)
        self.attn = HunyuanVideoSelfAttention(dim, num_heads, head_dim)
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, mlp_dim)
        self.proj_out = nn.Linear(dim + mlp_dim, dim)

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, inputs: JointBlockInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video, context) after the block."""
        video_len = x.shape[1]
        h = torch.cat([x, ctx], dim=1)
        norm_h, gate = self.norm(h, inputs.temb_act)
        mlp = F.gelu(self.proj_mlp(norm_h), approximate="tanh")
        attn = self.attn(norm_h, video_len, inputs.rope, inputs.key_mask)
        h = gated_residual(h, gate.unsqueeze(1), self.proj_out(torch.cat([attn, mlp], dim=2)))
        return h[:, :video_len], h[:, video_len:]


class AdaLayerNormZeroSingle(nn.Module):
    """adaLN-Zero of a single-stream block: Linear(SiLU(temb)) -> (shift, scale, gate); returns the
    modulated input and the gate."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate = self.linear(temb_act).chunk(3, dim=1)
        return self.modulate(self.norm(x), scale=scale, shift=shift), gate
