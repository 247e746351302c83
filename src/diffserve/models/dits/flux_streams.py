"""`FluxStreamsDiT`: the module layout and rotary tables that FLUX.1's DiT shares with the DiTs built on
it (Chroma, LongCat-Image), which differ only in how they condition the blocks on the timestep.

All three embed the packed latents (`x_embedder`) and the text states (`context_embedder`), run
`num_layers` double-stream and `num_single_layers` single-stream blocks, and end in an adaLN output norm
and `proj_out`, under Diffusers' names; they take the same 3-axis rotary tables over [text; image] ids.
Keeping that here gives the layout, and so the weight names, one definition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from diffserve.layers.rotary import RopeTables, multi_axis_rope_tables
from diffserve.models.dits.base import DiffusersDiT

ROPE_THETA = 10000.0

#: A block class of the trunk: (inner dim, heads, head dim) -> the block.
BlockFactory = Callable[[int, int, int], nn.Module]
#: The output norm's class: (inner dim) -> the norm.
NormFactory = Callable[[int], nn.Module]


class FluxStreamsConfig(Protocol):
    """The config fields the shared layout reads (FLUX.1's, Chroma's and LongCat-Image's configs have them;
    the layout only reads them)."""

    in_channels: int
    out_channels: int | None
    patch_size: int
    num_layers: int
    num_single_layers: int
    joint_attention_dim: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, ...]
    inner_dim: int


class FluxStreamsDiT(DiffusersDiT):
    """A DiT with FLUX.1's embedders, double- and single-stream block lists and output head.

    A subclass registers its conditioning modules first, then calls `_add_streams` (the order of
    registration is the state dict's, Diffusers' order)."""

    config: FluxStreamsConfig
    context_embedder: nn.Linear
    x_embedder: nn.Linear
    transformer_blocks: nn.ModuleList
    single_transformer_blocks: nn.ModuleList
    proj_out: nn.Linear

    def _add_streams(self, block: BlockFactory, single_block: BlockFactory, norm_out: NormFactory) -> None:
        """Build and register, in this order, the embedders, `num_layers` x `block`, `num_single_layers` x
        `single_block`, the output norm `norm_out(inner)` and `proj_out`, under Diffusers' names. The order
        is that of construction too, so that randomly initialised (tiny) models draw the same weights."""
        config = self.config
        inner, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        out_channels = config.out_channels
        assert out_channels is not None, "the config resolves out_channels"
        self.context_embedder = nn.Linear(config.joint_attention_dim, inner)
        self.x_embedder = nn.Linear(config.in_channels, inner)
        self.transformer_blocks = nn.ModuleList(
            [block(inner, heads, head_dim) for _ in range(config.num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [single_block(inner, heads, head_dim) for _ in range(config.num_single_layers)]
        )
        self.norm_out = norm_out(inner)
        self.proj_out = nn.Linear(inner, config.patch_size * config.patch_size * out_channels)

    def check_packed_latents(self, latent_channels: int, condition_channels: int = 0) -> None:
        """ValueError unless this DiT denoises latents of `latent_channels` channels packed in 2x2 patches,
        as the pipelines on it pack them: each image token it reads is 4 x `latent_channels` wide, plus
        `condition_channels` a pipeline appends to every token (FLUX.1 Fill's masked image and mask), and
        it predicts 4 x `latent_channels` per token (its `proj_out`: patch_size^2 x out_channels). A config
        that breaks this fails at Diffusers' first step; here it is refused at load, naming the keys."""
        config = self.config
        packed = 4 * latent_channels
        reads = packed + condition_channels
        if config.in_channels != reads:
            extra = f" + {condition_channels} condition channels" if condition_channels else ""
            raise ValueError(
                f"transformer/config.json has in_channels {config.in_channels}, but its image tokens are "
                f"{reads} channels wide: 4 x the VAE's {latent_channels} latent channels (2x2 patches){extra}"
            )
        assert config.out_channels is not None, "the config resolves out_channels"
        predicted = config.patch_size**2 * config.out_channels
        if predicted != packed:
            raise ValueError(
                f"transformer/config.json's patch_size^2 x out_channels ({config.patch_size}^2 x "
                f"{config.out_channels} = {predicted}) must be {packed}, the packed latents' channels (4 x "
                f"the VAE's {latent_channels} latent channels): that is what the DiT predicts per token"
            )

    def rope_tables(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> RopeTables:
        """Half-width (cos, sin) tables for the joint sequence [text; image].

        They depend only on the ids, i.e. on the request's shape; a caller that runs many steps (or
        many same-shape requests) can compute them once and pass them to `forward(rope=...)`.
        """
        axes_dims = self.config.axes_dims_rope
        for name, ids in (("txt_ids", txt_ids), ("img_ids", img_ids)):
            if ids.ndim != 2:
                raise ValueError(f"{name} must be 2-D (seq, {len(axes_dims)}), got {tuple(ids.shape)}")
        return multi_axis_rope_tables(torch.cat([txt_ids, img_ids], dim=0), axes_dims, ROPE_THETA)

    def embed_context(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """Text states (batch, txt_seq, joint_attention_dim) -> the blocks' text stream (batch, txt_seq, inner)."""
        return self.context_embedder(encoder_hidden_states)
