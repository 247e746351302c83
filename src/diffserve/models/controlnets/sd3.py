"""SD3 ControlNet (Diffusers' `SD3ControlNetModel`, InstantX / Stability layout with joint blocks), native,
loading Diffusers weights unchanged.

A shorter copy of the SD3 DiT (its own joint blocks, every one updating the text stream, the same patch,
timestep and caption embedders) whose image tokens are the patched latents (with their position table)
plus `pos_embed_input(control latents)`, a patch projection without positions. After each block a
zero-initialised Linear (`controlnet_blocks`) maps the image stream to a residual; scaled by the request's
conditioning scale, those are what the SD3 DiT takes as `block_controlnet_hidden_states`
(`models/dits/sd3.py`, `BlockResiduals(truncating=True)`).

SD3.5-Large's ControlNets (no `joint_attention_dim`: single-stream blocks, and `use_pos_embed` false: the
DiT's position table) are the same Diffusers class with another config: `SD3ControlNetModel.from_config`
builds them as `SD3SingleStreamControlNetModel` (sd3_single_stream.py). Either kind may take the DiT's
patch embedding and positions (`use_pos_embed` false, `TransformerPositions`) or patch its latents without
positions (`pos_embed_type` None), as Diffusers' `PatchEmbed` does. An inpainting ControlNet
(`extra_conditioning_channels`: the masked image's latents plus the mask as control latents) is the same
model with a wider `pos_embed_input`; `families/sd3/controlnet.py` prepares its control latents.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.controlnets.residuals import scaled_samples
from diffserve.models.dits.sd3 import (
    JointTransformerBlock,
    PatchEmbed,
    SD3Transformer2DModel,
    SD3TransformerConfig,
)

#: `pos_embed_type` values of a ControlNet with a patch embedding of its own (`use_pos_embed`): "sincos" adds
#: the checkpoint's position table, None patches the latents without positions (Diffusers' `PatchEmbed`).
POS_EMBED_TYPES = ("sincos", None)


@dataclass(frozen=True)
class SD3ControlNetConfig(SD3TransformerConfig):
    """`controlnet/config.json` of an `SD3ControlNetModel`: the DiT's keys and the ControlNet's own."""

    #: None: single-stream blocks that read no text (SD3.5-Large's ControlNets).
    joint_attention_dim: int | None = 4096
    extra_conditioning_channels: int = 0
    pos_embed_type: str | None = "sincos"
    #: False: the latents take the DiT's patch embedding and position table (SD3.5-Large's ControlNets).
    use_pos_embed: bool = True
    #: The pipeline hands the ControlNet zeros for the pooled projection (read by the pipeline).
    force_zeros_for_pooled_projection: bool = True

    @property
    def single_stream(self) -> bool:
        return self.joint_attention_dim is None

    @property
    def inpainting(self) -> bool:
        """An inpainting ControlNet (alimama's): its control latents carry the mask as extra channels, and a
        request's entry needs a `mask` (Diffusers' `StableDiffusion3ControlNetInpaintingPipeline`)."""
        return self.extra_conditioning_channels > 0

    @property
    def control_channels(self) -> int:
        """Channels of the control latents `pos_embed_input` reads: the latents', plus the mask's."""
        return self.in_channels + self.extra_conditioning_channels

    def __post_init__(self) -> None:
        if self.use_pos_embed and self.pos_embed_type not in POS_EMBED_TYPES:
            raise ValueError(
                f"SD3ControlNetModel: pos_embed_type {self.pos_embed_type!r} is not supported; one of "
                f"{list(POS_EMBED_TYPES)} (Diffusers' PatchEmbed refuses any other)"
            )
        if self.extra_conditioning_channels < 0:
            raise ValueError(
                f"SD3ControlNetModel: extra_conditioning_channels must be >= 0, got {self.extra_conditioning_channels}"
            )
        super().__post_init__()


class ControlPatchEmbed(nn.Module):
    """Diffusers' `PatchEmbed` without a position table: the conv patchify, flattened to tokens."""

    def __init__(self, in_channels: int, dim: int, patch_size: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.proj(latents).flatten(2).transpose(1, 2)


class TransformerPositions:
    """What a ControlNet with `use_pos_embed` false needs: it patches its latents with a copy of the DiT's
    patch embedding and position table, which Diffusers' pipeline hands it when it is built
    (`_get_pos_embed_from_transformer`) and the SD3 pipeline here when the ControlNet is handed to it
    (`use_controlnets`). SD3.5-Large's ControlNets are of this kind; a joint-block one may be too."""

    pos_embed: PatchEmbed | ControlPatchEmbed | None
    inner_dim: int
    time_text_embed: nn.Module

    @property
    def needs_transformer_pos_embed(self) -> bool:
        return self.pos_embed is None

    def use_transformer_pos_embed(self, pos_embed: PatchEmbed) -> None:
        """Take a copy of the DiT's patch embedding and position table (`pos_embed`), on this ControlNet's
        device and in its dtype, as Diffusers' pipeline does; the DiT's own stays as loaded."""
        if pos_embed.dim != self.inner_dim:
            raise ValueError(
                f"this SD3 ControlNet is {self.inner_dim} wide and the DiT {pos_embed.dim}: it was trained for "
                "another SD3 model"
            )
        reference = next(self.time_text_embed.parameters())
        self.pos_embed = copy.deepcopy(pos_embed).to(device=reference.device, dtype=reference.dtype)

    def patched(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states` latents as tokens through `pos_embed` (RuntimeError while it waits for the DiT's)."""
        if self.pos_embed is None:
            raise RuntimeError(
                "this SD3 ControlNet takes the DiT's positions: hand it to the SD3 pipeline (use_controlnets) "
                "before running it"
            )
        return self.pos_embed(hidden_states)


class SD3ControlNetModel(TransformerPositions, SD3Transformer2DModel):
    """SD3 ControlNet: `forward` returns the scaled residual samples of its blocks, as Diffusers'
    `controlnet_block_samples`."""

    diffusers_class_name: ClassVar[str] = "SD3ControlNetModel"
    config_class = SD3ControlNetConfig
    cache_methods: ClassVar[frozenset[str]] = frozenset()
    cache_block_lists: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> nn.Module:  # type: ignore[override]
        """The native module of a Diffusers `SD3ControlNetModel` config: this class for joint blocks,
        `SD3SingleStreamControlNetModel` for SD3.5-Large's single-stream ones (no `joint_attention_dim`)."""
        if config.get("joint_attention_dim", SD3ControlNetConfig.joint_attention_dim) is None:
            from diffserve.models.controlnets.sd3_single_stream import SD3SingleStreamControlNetModel

            return SD3SingleStreamControlNetModel.from_config(config)
        return super().from_config(config)

    def __init__(self, config: SD3ControlNetConfig) -> None:
        super().__init__(config)
        del self.norm_out, self.proj_out  # a ControlNet has no output head
        inner = config.inner_dim
        self.pos_embed: PatchEmbed | ControlPatchEmbed | None
        if not config.use_pos_embed:  # the DiT's, handed over by the pipeline
            self.pos_embed = None
        elif config.pos_embed_type is None:  # its latents are patched without positions
            self.pos_embed = ControlPatchEmbed(config.in_channels, inner, config.patch_size)
        # Every block updates the text stream (the DiT's last one does not).
        self.transformer_blocks = nn.ModuleList(
            [
                JointTransformerBlock(
                    inner,
                    config.num_attention_heads,
                    config.attention_head_dim,
                    context_pre_only=False,
                    qk_norm=config.qk_norm,
                    use_dual_attention=i in config.dual_attention_layers,
                )
                for i in range(config.num_layers)
            ]
        )
        self.controlnet_blocks = nn.ModuleList([nn.Linear(inner, inner) for _ in range(config.num_layers)])
        self.pos_embed_input = ControlPatchEmbed(config.control_channels, inner, config.patch_size)

    def shard_for_tensor_parallel(self, tp: object) -> None:  # type: ignore[override]
        raise ValueError("SD3 ControlNets run whole on every rank; they are not tensor-parallel")

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        controlnet_cond: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        scales: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The residual sample of every block, each (rows, image tokens, inner), times its row's scale.

        `hidden_states` / `controlnet_cond`: (rows, channels, H, W) latents and control latents;
        `timestep` in Diffusers' units (sigma * 1000), as for the DiT; `scales` (rows,)."""
        x = self.patched(hidden_states)
        temb_act = F.silu(self.time_text_embed(timestep, pooled_projections))
        ctx = self.context_embedder(encoder_hidden_states)
        x = x + self.pos_embed_input(controlnet_cond)
        samples = []
        for block, head in zip(self.transformer_blocks, self.controlnet_blocks, strict=True):
            ctx, x = block(x, ctx, temb_act)
            samples.append(head(x))
        return scaled_samples(samples, scales)
