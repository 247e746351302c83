"""LongCat-Image transformer (Meituan), native, loading Diffusers `LongCatImageTransformer2DModel` weights
unchanged.

The architecture is FLUX.1's (`models/dits/flux.py`): double-stream MMDiT blocks, then single-stream blocks
over [text; image], adaLN conditioning on one timestep vector per sample, 3-axis RoPE with theta 10000, and
the same parameter names inside every block. What differs:

    temb = MLP(sinusoids(t))       under `time_embed.timestep_embedder`: no pooled text, no guidance embedding
    ctx  = context_embedder(Qwen2.5-VL states)                      (joint_attention_dim: the encoder's width)

The position ids carry the modality on their first axis (text 0, image 1) and the image grid starts after
the 512 text positions; the pipeline makes them, the maths of the tables is FLUX's. So this class is the
FLUX DiT with its own timestep embedding: it inherits the blocks, the projection fusion, the block loop
(sequence splitting, step cache, block-range caches) and tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.adaln import AdaLayerNormContinuous
from diffserve.layers.embeddings import TimestepEmbedding, timestep_sinusoids
from diffserve.layers.rotary import RopeTables, checked_rope_axes
from diffserve.layers.tensor_parallel import TensorParallelRank
from diffserve.models.dits.base import DiffusersDiT, DiTConfig, check_tp_divides
from diffserve.models.dits.block_inputs import run_streams_with_step_cache
from diffserve.models.dits.flux import (
    FluxBlockInputs,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)
from diffserve.models.dits.input_checks import check_one_text_input, check_per_sample
from diffserve.models.step_cache import BatchStepCache

#: Channels of the timestep sinusoids (Diffusers' `Timesteps(num_channels=256)`).
TIMESTEP_CHANNELS = 256


@dataclass(frozen=True)
class LongCatImageTransformerConfig(DiTConfig):
    """The LongCat-Image DiT's Diffusers config (`transformer/config.json`), one field per key; the
    defaults are the released model's. `pooled_projection_dim` is a key of the config that no layer reads."""

    patch_size: int = 1
    in_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    pooled_projection_dim: int = 3584
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self) -> None:
        axes = checked_rope_axes("axes_dims_rope", self.axes_dims_rope, self.attention_head_dim)
        self._normalise(axes_dims_rope=axes)

    @property
    def out_channels(self) -> int:
        """The output head predicts as many channels as the packed latents have."""
        return self.in_channels

    @property
    def guidance_embeds(self) -> bool:
        """LongCat-Image is not guidance-distilled: CFG runs as two branches."""
        return False


class LongCatTimestepEmbedding(nn.Module):
    """temb = MLP(sinusoids(t)) in the activations' dtype (Diffusers' `LongCatImageTimestepEmbeddings`; its
    sinusoid projection has no weights)."""

    def __init__(self, embedding_dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, embedding_dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_sinusoids(timestep, TIMESTEP_CHANNELS).to(dtype))


class LongCatImageTransformer2DModel(FluxTransformer2DModel):
    """The LongCat-Image DiT (`DiffusersDiT`, from a `LongCatImageTransformerConfig`): FLUX.1's blocks and
    block loop with `LongCatTimestepEmbedding` in place of FLUX's combined timestep/text/guidance one."""

    diffusers_class_name: ClassVar[str] = "LongCatImageTransformer2DModel"
    config_class = LongCatImageTransformerConfig

    def __init__(self, config: LongCatImageTransformerConfig) -> None:
        # FLUX.1's modules but its timestep embedding (so its own constructor is skipped, not undone).
        DiffusersDiT.__init__(self, config)
        self.time_embed = LongCatTimestepEmbedding(config.inner_dim)
        self._add_streams(FluxTransformerBlock, FluxSingleTransformerBlock, AdaLayerNormContinuous)
        self.adaln_modulation: nn.Linear | None = None
        self._adaln_sizes: list[int] = []

    def shard_for_tensor_parallel(self, tp: TensorParallelRank) -> None:
        """FLUX.1's sharding (`FluxTransformer2DModel.shard_for_tensor_parallel`); the timestep embedding stays
        whole on every rank, as FLUX's does."""
        heads = self.config.num_attention_heads
        check_tp_divides(tp, heads, f"the LongCat-Image DiT's {heads} attention heads do not divide")
        super().shard_for_tensor_parallel(tp)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        rope: RopeTables | None = None,
        step_cache: BatchStepCache | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity for packed latents.

        Args:
            hidden_states: packed image latents (batch, img_seq, in_channels).
            encoder_hidden_states: Qwen2.5-VL states (batch, txt_seq, joint_attention_dim).
            timestep: (batch,) or (1,) in [0, 1] (sigma); scaled by 1000 here, as in Diffusers.
            img_ids, txt_ids: position ids (img_seq, 3) and (txt_seq, 3), shared by the batch.
            rope: precomputed `rope_tables(txt_ids, img_ids)`; computed from the ids when None.
            step_cache: rows that may reuse an earlier step's residual (`models/step_cache.py`), or None.
            context: `embed_context(encoder_hidden_states)`, given instead of `encoder_hidden_states`.

        Returns:
            (batch, img_seq, patch_size**2 * in_channels).
        """
        batch = hidden_states.shape[0]
        check_per_sample(batch, timestep=timestep)
        check_one_text_input(encoder_hidden_states, context, "encoder states")
        if rope is None:
            rope = self.rope_tables(txt_ids, img_ids)

        x = self.x_embedder(hidden_states)
        # Rounded to the activation dtype before scaling, as Diffusers does (it matters in bf16).
        temb = self.time_embed(timestep.to(x.dtype) * 1000, x.dtype)
        *block_mods, out_mod = self._modulations(F.silu(temb))
        ctx = self.embed_context(encoder_hidden_states) if context is None else context
        inputs = FluxBlockInputs(block_mods, rope)

        signal = partial(self._cache_signal, x, block_mods)
        x = run_streams_with_step_cache(
            step_cache, x, ctx, inputs, signal, self._run_blocks, self._block_range
        )
        x = self.norm_out.modulate_projected(x, out_mod)
        return self.proj_out(x)
