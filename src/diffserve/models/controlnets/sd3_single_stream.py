"""SD3.5-Large's ControlNets (Diffusers' `SD3ControlNetModel` with no `joint_attention_dim` and
`use_pos_embed` false, Stability's canny / depth / blur ones), native, loading Diffusers weights unchanged.

Single-stream blocks (`SD3SingleTransformerBlock`: adaLN-Zero, self-attention over the image tokens, a
GELU MLP) that read no text: the tokens are the latents patched by the DiT's own patch embedding and
position table, plus `pos_embed_input(control latents)`. Diffusers' pipeline gives the ControlNet a copy of
the DiT's `pos_embed` when it is built (`_get_pos_embed_from_transformer`); the SD3 pipeline here does the
same when the ControlNet is handed to it (`use_transformer_pos_embed`). After each block a Linear
(`controlnet_blocks`) maps the image stream to a residual for the DiT, scaled per row as the joint
ControlNet's (`models/controlnets/sd3.py`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.adaln import AdaLayerNormZero
from diffserve.layers.embeddings import CombinedTimestepTextEmbedding
from diffserve.layers.feedforward import FeedForward
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm
from diffserve.models.controlnets.residuals import scaled_samples
from diffserve.models.controlnets.sd3 import ControlPatchEmbed, SD3ControlNetConfig, TransformerPositions
from diffserve.models.dits.base import DiffusersDiT
from diffserve.models.dits.sd3 import NORM_EPS, PatchEmbed, SD3SelfAttention


class SD3SingleTransformerBlock(nn.Module):
    """Diffusers' `SD3SingleTransformerBlock`: adaLN-Zero, image self-attention (no QK norm), GELU MLP."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim)
        self.attn = SD3SelfAttention(dim, num_heads, head_dim, qk_norm=None)
        self.norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff = FeedForward(dim)
        self.modulate = Modulate()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb_act)
        x = x + gate_msa.unsqueeze(1) * self.attn(norm_x)
        ff_in = self.modulate(self.norm2(x), scale=scale_mlp, shift=shift_mlp)
        return x + gate_mlp.unsqueeze(1) * self.ff(ff_in)


class SD3SingleStreamControlNetModel(TransformerPositions, DiffusersDiT):
    """An SD3.5-Large ControlNet: `forward` returns the scaled residual samples of its blocks, as the joint
    `SD3ControlNetModel`'s (same arguments; the text is not read)."""

    diffusers_class_name: ClassVar[str] = "SD3ControlNetModel"
    config_class = SD3ControlNetConfig
    cache_methods: ClassVar[frozenset[str]] = frozenset()
    cache_block_lists: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: SD3ControlNetConfig) -> None:
        super().__init__(config)
        inner, patch = config.inner_dim, config.patch_size
        #: Its own positions (`use_pos_embed`), else a copy of the DiT's (`use_transformer_pos_embed`).
        self.pos_embed: PatchEmbed | ControlPatchEmbed | None = None
        if config.use_pos_embed and config.pos_embed_type is None:  # its own patching, no positions
            self.pos_embed = ControlPatchEmbed(config.in_channels, inner, patch)
        elif config.use_pos_embed:
            self.pos_embed = PatchEmbed(
                config.in_channels, inner, patch, config.sample_size // patch, config.pos_embed_max_size
            )
        self.time_text_embed = CombinedTimestepTextEmbedding(inner, config.pooled_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            [
                SD3SingleTransformerBlock(inner, config.num_attention_heads, config.attention_head_dim)
                for _ in range(config.num_layers)
            ]
        )
        self.controlnet_blocks = nn.ModuleList([nn.Linear(inner, inner) for _ in range(config.num_layers)])
        self.pos_embed_input = ControlPatchEmbed(config.control_channels, inner, patch)

    def shard_for_tensor_parallel(self, tp: object) -> None:
        raise ValueError("SD3 ControlNets run whole on every rank; they are not tensor-parallel")

    def forward(
        self,
        hidden_states: torch.Tensor,
        controlnet_cond: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        scales: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The residual sample of every block, each (rows, image tokens, inner), times its row's scale;
        arguments as `SD3ControlNetModel.forward` (`encoder_hidden_states` is not read)."""
        del encoder_hidden_states  # Diffusers' pipeline passes none to these ControlNets
        x = self.patched(hidden_states)
        temb_act = F.silu(self.time_text_embed(timestep, pooled_projections))
        x = x + self.pos_embed_input(controlnet_cond)
        samples = []
        for block, head in zip(self.transformer_blocks, self.controlnet_blocks, strict=True):
            x = block(x, temb_act)
            samples.append(head(x))
        return scaled_samples(samples, scales)
