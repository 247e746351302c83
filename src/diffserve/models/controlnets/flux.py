"""FLUX.1 ControlNet (InstantX / Shakker-Labs layout, Diffusers' `FluxControlNetModel`), native, loading
Diffusers weights unchanged.

A ControlNet is a shorter copy of the FLUX DiT (its own double- and single-stream blocks, the same
embedders) whose image tokens are the noisy latents plus `controlnet_x_embedder(control latents)`. After
each of its blocks, a zero-initialised Linear (`controlnet_blocks`, `controlnet_single_blocks`) maps the
image stream to a residual; scaled by the request's conditioning scale, those residuals are added to
the image stream of the DiT's blocks (`models/controlnets/residuals.py`). A Union ControlNet (`num_mode`
set) prepends one embedded token, the control mode (canny, depth, ...), to its text stream.

The blocks, embedders and projection fusion are the DiT's (`models/dits/flux.py`); the DiT's output head
(`norm_out`, `proj_out`) does not exist here. XLabs' layout (`conditioning_embedding_channels`) reads the
control image itself through a pixel-space `input_hint_block` (`hint_encoder.py`), packed into patches of
`patch_size`, instead of the control image's latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.controlnets.hint_encoder import ControlHintEncoder
from diffserve.models.controlnets.residuals import scaled_samples
from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig


@dataclass(frozen=True)
class FluxControlNetConfig(FluxTransformerConfig):
    """`controlnet/config.json` of a `FluxControlNetModel`: the DiT's keys, and Union's mode count."""

    #: Union ControlNets: how many control modes the mode embedding holds (None: a single-mode model).
    num_mode: int | None = None
    #: XLabs' ControlNets: the pixel-space hint encoder's output channels (None: InstantX's, which read the
    #: control image's VAE latents).
    conditioning_embedding_channels: int | None = None

    @property
    def reads_pixels(self) -> bool:
        """Whether the ControlNet reads the control image itself (XLabs' `input_hint_block`), not its
        latents; its double-stream samples then cycle over the DiT's blocks (`controlnet_blocks_repeat`)."""
        return self.conditioning_embedding_channels is not None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reads_pixels:
            hint = self.conditioning_embedding_channels * self.patch_size**2
            if hint != self.in_channels:
                raise ValueError(
                    "FluxControlNetModel: conditioning_embedding_channels x patch_size^2 "
                    f"({self.conditioning_embedding_channels} x {self.patch_size}^2) must equal in_channels "
                    f"({self.in_channels})"
                )
        if self.num_mode is not None and (isinstance(self.num_mode, bool) or self.num_mode < 1):
            raise ValueError(f"FluxControlNetModel: num_mode must be a positive integer, got {self.num_mode}")


@dataclass(frozen=True)
class ControlNetBatch:
    """One ControlNet forward's rows: each row a (request, control entry) at its own timestep.

    `latents`, `control` (packed control latents; an XLabs ControlNet's: the control images, (rows, 3, H, W)
    in [-1, 1]) and `context` (the ControlNet's embedded text) are (rows, tokens, width); `pooled` (rows, pooled dim); `timestep` and `guidance` (rows,) sigma and
    embedded-guidance values (guidance None when the ControlNet has no guidance embedding); `modes` (rows,)
    Union control modes or None; `scales` (rows,) conditioning scales."""

    latents: torch.Tensor
    control: torch.Tensor
    context: torch.Tensor
    pooled: torch.Tensor
    timestep: torch.Tensor
    guidance: torch.Tensor | None
    modes: torch.Tensor | None
    scales: torch.Tensor


def patchify(features: torch.Tensor, patch: int) -> torch.Tensor:
    """(rows, C, H, W) -> (rows, H/patch * W/patch, C * patch^2): Diffusers' packing of the hint encoder's
    output (channel-major within a token, as the latents' 2x2 packing)."""
    rows, channels, height, width = features.shape
    grid = features.reshape(rows, channels, height // patch, patch, width // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(rows, (height // patch) * (width // patch), -1)


class FluxControlNetModel(FluxTransformer2DModel):
    """FLUX.1 ControlNet: `forward` returns the scaled residual samples of its double- and single-stream
    blocks, as Diffusers' (`controlnet_block_samples`, `controlnet_single_block_samples`)."""

    diffusers_class_name: ClassVar[str] = "FluxControlNetModel"
    config_class = FluxControlNetConfig
    cache_methods: ClassVar[frozenset[str]] = frozenset()
    cache_block_lists: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: FluxControlNetConfig) -> None:
        super().__init__(config)
        del self.norm_out, self.proj_out  # a ControlNet has no output head
        inner = config.inner_dim
        self.controlnet_blocks = nn.ModuleList([nn.Linear(inner, inner) for _ in range(config.num_layers)])
        self.controlnet_single_blocks = nn.ModuleList(
            [nn.Linear(inner, inner) for _ in range(config.num_single_layers)]
        )
        self.controlnet_mode_embedder = (
            nn.Embedding(config.num_mode, inner) if config.num_mode is not None else None
        )
        self.controlnet_x_embedder = nn.Linear(config.in_channels, inner)
        self.input_hint_block = (
            ControlHintEncoder(config.conditioning_embedding_channels) if config.reads_pixels else None
        )

    @property
    def hint_pixels_per_token(self) -> int | None:
        """XLabs' layout: the side in pixels of the control image's square that one image token reads, the
        hint encoder's downsampling times `patch_size` (None for a ControlNet that reads latents). The
        hint's token grid must be the latents' (the pipeline's pixels per token, VAE scale x 2)."""
        if self.input_hint_block is None:
            return None
        halvings = sum(conv.stride == (2, 2) for conv in self.input_hint_block.blocks)
        return 2**halvings * self.config.patch_size

    @property
    def is_union(self) -> bool:
        """Whether requests must name a control mode (`num_mode` set)."""
        return self.controlnet_mode_embedder is not None

    def _adaln_projections(self) -> list[tuple[str, nn.Linear]]:
        """The blocks' adaLN projections (the DiT's list without the output head's)."""
        return self._block_adaln_projections()

    def shard_for_tensor_parallel(self, tp: object) -> None:  # type: ignore[override]
        raise ValueError("FLUX.1 ControlNets run whole on every rank; they are not tensor-parallel")

    def forward(  # type: ignore[override]
        self,
        batch: ControlNetBatch,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The residual samples of every block, each (rows, image tokens, inner), times its row's scale.

        `img_ids` / `txt_ids`: the request shape's position ids, as for the DiT (a Union ControlNet's mode
        token takes the first text id, as Diffusers does)."""
        control = batch.control
        if self.input_hint_block is not None:  # XLabs': the control image, encoded and packed here
            control = patchify(self.input_hint_block(control), self.config.patch_size)
        x = self.x_embedder(batch.latents) + self.controlnet_x_embedder(control)
        # Rounded to the activation dtype before scaling, as Diffusers does.
        timestep = batch.timestep.to(x.dtype) * 1000
        guidance = None if batch.guidance is None else batch.guidance.to(x.dtype) * 1000
        temb = self.time_text_embed(timestep, batch.pooled, guidance)
        mods = self._modulations(F.silu(temb))
        ctx = batch.context
        if self.controlnet_mode_embedder is not None:
            if batch.modes is None:
                raise ValueError("a Union ControlNet needs a control mode per row")
            mode_token = self.controlnet_mode_embedder(batch.modes[:, None])
            ctx = torch.cat([mode_token, ctx], dim=1)
            txt_ids = torch.cat([txt_ids[:1], txt_ids], dim=0)
        rope = self.rope_tables(txt_ids, img_ids)

        mods_iter = iter(mods)
        double_samples = []
        for block, head in zip(self.transformer_blocks, self.controlnet_blocks, strict=True):
            ctx, x = block(x, ctx, next(mods_iter), next(mods_iter), rope)
            double_samples.append(head(x))
        single_samples = []
        text_len = ctx.shape[1]
        h = torch.cat([ctx, x], dim=1)
        n_single = len(self.single_transformer_blocks)
        pairs = zip(self.single_transformer_blocks, self.controlnet_single_blocks, strict=True)
        for i, (block, head) in enumerate(pairs):
            if i == n_single - 1:  # nothing reads the last block's text rows
                image = block(h, next(mods_iter), rope, text_len=text_len)
            else:
                h = block(h, next(mods_iter), rope)
                image = h[:, text_len:]
            single_samples.append(head(image))
        return scaled_samples(double_samples, batch.scales), scaled_samples(single_samples, batch.scales)
