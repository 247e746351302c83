"""Qwen-Image ControlNet (InstantX layout, Diffusers' `QwenImageControlNetModel`), native, loading Diffusers
weights unchanged.

A shorter copy of the Qwen-Image DiT (its own double-stream blocks, the same embedders and RoPE) whose image
tokens are the noisy latents' `img_in` plus `controlnet_x_embedder(control latents)`. After each block, a
zero-initialised Linear (`controlnet_blocks`) maps the image stream to a residual; scaled by the request's
conditioning scale, those residuals are added to the DiT's image stream after its blocks
(`models/controlnets/residuals.py`, the "double" kind). Diffusers' `QwenImageMultiControlNetModel` is one
such (Union) ControlNet applied to several control images, the samples summed: requests list the same
ControlNet several times.

The blocks, embedders and RoPE are the DiT's (`models/dits/qwen_image.py`); the DiT's output head does not
exist here. The inpainting variant (`extra_condition_channels`: the masked image's latents and the mask,
packed, as control latents) is the same model with a wider `controlnet_x_embedder`;
`families/qwen_image/controlnet.py` prepares its control latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.controlnets.residuals import scaled_samples
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel, QwenImageTransformerConfig


@dataclass(frozen=True)
class QwenImageControlNetConfig(QwenImageTransformerConfig):
    """`controlnet/config.json` of a `QwenImageControlNetModel`: the DiT's keys and the inpainting width."""

    #: The inpainting ControlNet's extra control channels (packed: the mask's 1 channel x 2x2 patch = 4).
    extra_condition_channels: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.extra_condition_channels < 0:
            raise ValueError(
                "QwenImageControlNetModel: extra_condition_channels must be >= 0, got "
                f"{self.extra_condition_channels}"
            )

    @property
    def inpainting(self) -> bool:
        """An inpainting ControlNet (InstantX's): its packed control latents carry the mask as extra
        channels, and a request's entry needs a `mask` (Diffusers' `QwenImageControlNetInpaintPipeline`)."""
        return self.extra_condition_channels > 0


@dataclass(frozen=True)
class QwenControlNetBatch:
    """One ControlNet forward's rows, each a (request, control entry) at its own timestep: `latents` and
    `control` (packed control latents) (rows, image tokens, channels); `text` (rows, text tokens, dim) the
    prompt's states, right-padded, with `text_mask` (rows, text tokens) or None when none is padded;
    `timestep` (rows,) sigmas; `scales` (rows,) conditioning scales; `img_shapes` the rows' latent grids."""

    latents: torch.Tensor
    control: torch.Tensor
    text: torch.Tensor
    text_mask: torch.Tensor | None
    timestep: torch.Tensor
    scales: torch.Tensor
    img_shapes: object


class QwenImageControlNetModel(QwenImageTransformer2DModel):
    """Qwen-Image ControlNet: `forward` returns the scaled residual samples of its blocks, as Diffusers'
    `controlnet_block_samples`."""

    diffusers_class_name: ClassVar[str] = "QwenImageControlNetModel"
    config_class = QwenImageControlNetConfig
    cache_methods: ClassVar[frozenset[str]] = frozenset()
    cache_block_lists: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: QwenImageControlNetConfig) -> None:
        super().__init__(config)
        del self.norm_out, self.proj_out  # a ControlNet has no output head
        inner = config.inner_dim
        self.controlnet_blocks = nn.ModuleList([nn.Linear(inner, inner) for _ in range(config.num_layers)])
        self.controlnet_x_embedder = nn.Linear(config.in_channels + config.extra_condition_channels, inner)

    def shard_for_tensor_parallel(self, tp: object) -> None:  # type: ignore[override]
        raise ValueError("Qwen-Image ControlNets run whole on every rank; they are not tensor-parallel")

    def forward(self, batch: QwenControlNetBatch) -> list[torch.Tensor]:  # type: ignore[override]
        """The residual sample of every block, each (rows, image tokens, inner), times its row's scale."""
        x = self.img_in(batch.latents) + self.controlnet_x_embedder(batch.control)
        rows, img_seq = x.shape[:2]
        txt_seq = batch.text.shape[1]
        # Rounded to the activation dtype first, as Diffusers does.
        temb_act = F.silu(self.time_text_embed(batch.timestep.to(x.dtype), x.dtype))
        ctx = self.txt_in(self.txt_norm(batch.text))
        attn_mask = None
        if batch.text_mask is not None:
            img_keys = torch.ones(rows, img_seq, dtype=torch.bool, device=x.device)
            attn_mask = torch.cat([batch.text_mask.to(torch.bool), img_keys], dim=1)[:, None, None, :]
        rope = self.rope_tables(batch.img_shapes, txt_seq, x.device, rows)
        samples = []
        last = len(self.transformer_blocks) - 1
        for i, (block, head) in enumerate(zip(self.transformer_blocks, self.controlnet_blocks, strict=True)):
            ctx, x = block(x, ctx, temb_act, rope, attn_mask, None, text_out=i < last)
            samples.append(head(x))
        return scaled_samples(samples, batch.scales)
