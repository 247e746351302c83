"""SkyReels-V2 video transformer (Skywork), native, loading Diffusers `SkyReelsV2Transformer3DModel` weights
unchanged.

SkyReels-V2's DiT is Wan 2.1's (`models/dits/wan.py`: same blocks, embedders, RoPE and weight names), with
these differences, all kept here:

- The timestep sinusoids are computed in float64 (`1 / 10000 ** (i / half)` frequencies, cosines first)
  and rounded to the time MLP's dtype, where Wan computes them in float32.
- `inject_sample_info`: an `fps_embedding` table (two rows: the index the diffusion-forcing pipeline
  passes) and an `fps_projection` MLP (Linear, SiLU, Linear to six vectors) whose output is added to every
  block's modulation (not to the output head's). Only the diffusion-forcing pipelines pass it.
- Diffusion forcing: a (batch, latent frames) timestep gives every frame its own timestep; each frame's
  tokens share it (the time MLP runs per frame, then the rows are repeated over the frame's tokens).
- `num_frame_per_block > 1`: block-causal self-attention, the tokens of frame block `i` attending to
  blocks `<= i` only (a (seq, seq) boolean mask; not under a sequence split, nor with the step cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.distributed.sequence_split import sequence_split
from diffserve.layers.patches import video_patch_grid
from diffserve.models.dits.wan import EmbeddedContext, WanTransformer3DModel, WanTransformerConfig
from diffserve.models.step_cache import BatchStepCache


@dataclass(frozen=True)
class SkyReelsV2TransformerConfig(WanTransformerConfig):
    """Wan's config keys with SkyReels-V2's defaults (Diffusers' `SkyReelsV2Transformer3DModel`: 16 heads x
    128, 32 layers, ffn 8192) and its two keys."""

    num_attention_heads: int = 16
    ffn_dim: int = 8192
    num_layers: int = 32
    inject_sample_info: bool = False
    num_frame_per_block: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.num_frame_per_block) < 1:
            raise ValueError(f"num_frame_per_block must be >= 1, got {self.num_frame_per_block}")


def float64_sinusoids(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """(n,) timesteps -> (n, dim) float64 sinusoids, cosines first (Diffusers' sin-cos grid embedding)."""
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float64, device=timesteps.device) / (dim / 2.0)
    args = timesteps.reshape(-1, 1).to(torch.float64) * (1.0 / 10000**exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class LinearSiLUProjection(nn.Module):
    """Diffusers' `FeedForward(dim, dim_out, mult=1, activation_fn="linear-silu")`: `net` = [Linear then
    SiLU (`net.0.proj`), dropout (an `nn.Identity`), Linear (`net.2`)]."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        first = nn.Module()
        first.proj = nn.Linear(dim, dim)
        self.net = nn.ModuleList([first, nn.Identity(), nn.Linear(dim, dim_out)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.silu(self.net[0].proj(x)))


class SkyReelsV2Transformer3DModel(WanTransformer3DModel):
    """SkyReels-V2 DiT (T2V, I2V, diffusion forcing) with Diffusers' config keys and state-dict names."""

    diffusers_class_name: ClassVar[str] = "SkyReelsV2Transformer3DModel"
    config_class = SkyReelsV2TransformerConfig

    def __init__(self, config: SkyReelsV2TransformerConfig) -> None:
        super().__init__(config)
        if config.inject_sample_info:
            self.fps_embedding = nn.Embedding(2, config.inner_dim)
            self.fps_projection = LinearSiLUProjection(config.inner_dim, 6 * config.inner_dim)

    def time_embedding(
        self, timestep: torch.Tensor, dtype: torch.dtype, fps: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, n) timesteps -> temb (batch, n, dim) and block modulation (batch, n, 6, dim), the fps
        projection added to the modulation when the model injects sample info."""
        embedder = self.condition_embedder
        weight_dtype = embedder.time_embedder.linear_1.weight.dtype
        sinusoids = float64_sinusoids(timestep, embedder.freq_dim).unflatten(0, timestep.shape)
        temb = embedder.time_embedder(sinusoids.to(weight_dtype)).to(dtype)
        time_mod = embedder.time_proj(F.silu(temb)).unflatten(-1, (6, -1))
        if self.config.inject_sample_info:
            if fps is None:
                raise ValueError("this SkyReels-V2 DiT injects sample info (inject_sample_info): pass fps")
            fps = torch.as_tensor(fps, dtype=torch.long, device=temb.device).reshape(-1)
            projected = self.fps_projection(self.fps_embedding(fps)).unflatten(-1, (6, -1))
            time_mod = time_mod + projected.unsqueeze(1)  # (1 or batch, 1, 6, dim)
        return temb, time_mod

    def block_causal_mask(
        self, frames: int, height: int, width: int, device: torch.device, per_block: int | None = None
    ) -> torch.Tensor | None:
        """(1, 1, seq, seq) bool: frame block `i`'s tokens attend to blocks `<= i`; None for one frame a block.
        `per_block`: frames per block (None: the config's `num_frame_per_block`)."""
        per_block = int(self.config.num_frame_per_block if per_block is None else per_block)
        if per_block <= 1:
            return None
        if frames % per_block:
            raise ValueError(
                f"{frames} latent frames are not a multiple of num_frame_per_block ({per_block})"
            )
        block = torch.arange(frames, device=device) // per_block
        frame_mask = block[None, :] <= block[:, None]  # (query frame, key frame)
        tokens = height * width
        mask = frame_mask.repeat_interleave(tokens, dim=0).repeat_interleave(tokens, dim=1)
        return mask[None, None]

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_hidden_states_image: torch.Tensor | None = None,
        fps: torch.Tensor | list[int] | None = None,
        step_cache: BatchStepCache | None = None,
        context: EmbeddedContext | None = None,
        num_frame_per_block: int | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for video latents (`WanTransformer3DModel.forward`'s inputs).

        `timestep`: (batch,) or (1,) one per row; (batch, latent frames) one per frame (diffusion forcing,
        Diffusers' `enable_diffusion_forcing=True`); or (batch, tokens) one per patch token. `fps`: the
        index (0 or 1) per row or one for all, needed by `inject_sample_info` models and ignored by others.
        `num_frame_per_block`: the block-causal attention's frames per block for this call (None: the config's;
        Diffusers' diffusion-forcing pipelines set it from their `causal_block_size`).
        """
        grid = video_patch_grid(hidden_states, self.config.patch_size)
        batch = hidden_states.shape[0]
        seq = math.prod(grid)
        tokens_per_frame = grid[1] * grid[2]
        per_frame = timestep.ndim == 2 and timestep.shape[1] == grid[0] and grid[0] != seq
        timestep = timestep.expand(batch, -1) if per_frame else self._timestep_rows(timestep, batch, seq)

        context = self._context_of(context, encoder_hidden_states, encoder_hidden_states_image)
        ctx, image_len = context.states, context.image_len

        rope = self.rope_tables(*grid, hidden_states.device)
        mask = self.block_causal_mask(*grid, hidden_states.device, num_frame_per_block)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        dtype = x.dtype
        temb, time_mod = self.time_embedding(timestep, ctx.dtype, fps)
        if per_frame:  # every token of a frame at its frame's timestep
            temb = temb.repeat_interleave(tokens_per_frame, dim=1)
            time_mod = time_mod.repeat_interleave(tokens_per_frame, dim=1)

        if mask is not None:
            if step_cache is not None or sequence_split([x.shape[1]]) is not None:
                raise ValueError(
                    "block-causal attention (num_frame_per_block > 1) runs without the step cache and "
                    "without a sequence split"
                )
            img, txt = (ctx[:, :image_len], ctx[:, image_len:]) if image_len else (None, ctx)
            for block in self.blocks:
                x = block(x, txt, img, time_mod, rope, mask)
        else:
            x = self._blocks_with_step_cache(step_cache, x, ctx, image_len, time_mod, rope)
        return self._output_head(x, temb, dtype, grid, tuple(hidden_states.shape))
