"""Each family's DiT loaded as tensor-parallel shards: each rank reads only its slices of the safetensors
file, and on gloo ranks (TP 2, and TP 2 x Ulysses 2 where listed) the sharded DiT equals the one-device
DiT.

Every family's tiny DiT is saved with seeded random weights (large enough that every block matters) as a
Diffusers folder; the sharded-load checks run in this process (`LoadOnlyRank`: a TP "rank" needs no
process group until a row-parallel layer's forward all-reduces); the forwards run on gloo ranks. The
batches are CFG-like pairs (one latent, two prompts, one timestep) plus a row at another timestep.

- FLUX: a non-square 6x5 grid, 2 rows at different timesteps; the reference is loaded by the component
  loader (fused QKV). On the TP 2 ranks, column- and row-parallel Linears (row: two segments) and a
  column -> GELU -> row MLP also equal plain Linears.
- Qwen-Image: the QK-norms are per head, so a head shard keeps them whole (no communication); the joint
  attention finds this rank's head count from the projections' width. The second prompt is padded (text
  mask) on a non-square grid.
- Z-Image: every block kind is sharded (the main layers, the noise refiner and the context refiner: q/k/v
  and the SwiGLU's w1/w3 column-parallel, `to_out` and w2 row-parallel); the per-head QK-norm stays whole.
  Two captions of different lengths, two timesteps and two non-square latents of different sizes, so every
  stream carries batch padding (masked) and per-sample RoPE tables. TP x Ulysses goes through the same
  sequence-split machinery as FLUX's and Wan's, tested here on the 2x2 mesh.
- Wan 2.1 (image-to-video): the QK-norm is an RMSNorm over all heads together, so a head shard must
  all-reduce the sum of squares (`ParallelRMSNorm`, also checked against the whole norm in fp32 and bf16 on
  the TP 2 ranks); with a per-shard norm the outputs would differ far beyond the bounds here. 45 tokens,
  split unevenly by Ulysses.
- SD3.5-medium-like, so that every sharded path runs: RMS QK-norm (per head, whole on every rank),
  dual-attention blocks (`attn2`), among them the last, `context_pre_only` block (no text output
  projection, no text MLP).

One `run_distributed` per mesh runs every family tested on it (starting the rank processes costs more
than the tiny forwards); a family that raises on the ranks fails its own test only. Whole generations
under TP are in test_tensor_parallel.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import ParallelState, build_parallel_state, parallel_scope
from diffserve.errors import ModelLoadError
from diffserve.layers.norms import RMSNorm
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelRMSNorm,
    RowParallelLinear,
    ShardSpec,
    tensor_parallel_shards,
)
from diffserve.loader import safetensors_weights
from diffserve.loader.safetensors_weights import load_safetensors_into
from diffserve.models.dits.chroma import ChromaTransformer2DModel
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.testing.distributed import (
    CaseResult,
    LoadOnlyRank,
    MeshRuns,
    case_results,
    run_distributed,
)

WEIGHTS = "diffusion_pytorch_model.safetensors"
#: (world size, Ulysses degree) by test id; TP is 2 on every mesh.
MESHES = {"tp2": (2, 1), "tp2xulysses2": (4, 2)}
Specs = dict[str, ShardSpec]
State = dict[str, torch.Tensor]

# ----------------------------------------------------------------------------------------------- FLUX

FLUX_CONFIG = {
    "patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 2, "num_single_layers": 2,
    "attention_head_dim": 8, "num_attention_heads": 4, "joint_attention_dim": 24,
    "pooled_projection_dim": 12, "guidance_embeds": True, "axes_dims_rope": [2, 2, 4],
}  # fmt: skip
FLUX_TEXT_LEN, FLUX_GRID_H, FLUX_GRID_W = 7, 6, 5


def flux_inputs() -> dict[str, torch.Tensor]:
    """A CFG-like batch of 2 rows at different timesteps on a non-square grid (`diffserve.families.flux.tiny`
    imports transformers: made in this process, as every family's inputs are, and sent to the ranks)."""
    from diffserve.families.flux.tiny import flux_dit_inputs

    return flux_dit_inputs(FLUX_GRID_H, FLUX_GRID_W, FLUX_TEXT_LEN, timesteps=[0.9, 0.3])


def flux_shards(model: nn.Module, specs: Specs, state: State, rank: int) -> None:
    # proj_out of a single-stream block reads its piece of the attention columns and of the MLP columns.
    assert specs["single_transformer_blocks.0.proj_out.weight"].ranges == (
        ((0, 16), (32, 96)) if rank == 0 else ((16, 32), (96, 160))
    )


def flux_layer_errors(state: ParallelState) -> dict[str, float]:
    """Column, row (two segments) and a column -> GELU -> row MLP against plain Linears."""
    torch.manual_seed(3)
    first, second = nn.Linear(12, 16), nn.Linear(16, 12)
    x = torch.randn(3, 5, 12)
    column = ColumnParallelLinear.replacing(first, state)
    row = RowParallelLinear.replacing(second, state, segments=(4, 12))
    for sharded, whole in ((column, first), (row, second)):
        params = dict(whole.named_parameters())
        specs = sharded.shard_specs()
        sharded.load_state_dict({n: specs[n].take(p) if n in specs else p for n, p in params.items()})
    with torch.no_grad():
        pieces = [torch.empty(3, 5, 8) for _ in range(2)]
        dist.all_gather(pieces, column(x).contiguous(), group=state.tp_group)
        hidden = torch.nn.functional.gelu(first(x))
        local_hidden = ShardSpec(tuple(hidden.shape), 2, row.shard_specs()["weight"].ranges).take(hidden)
        return {
            "column": (torch.cat(pieces, dim=-1) - first(x)).abs().max().item(),
            "row": (row(local_hidden) - second(hidden)).abs().max().item(),
        }


# --------------------------------------------------------------------------------------------- Chroma

#: FLUX's block widths (so `flux_shards` checks its blocks too), with a small approximator.
CHROMA_CONFIG = {
    "patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 2, "num_single_layers": 2,
    "attention_head_dim": 8, "num_attention_heads": 4, "joint_attention_dim": 24, "axes_dims_rope": [2, 2, 4],
    "approximator_num_channels": 16, "approximator_hidden_dim": 32, "approximator_layers": 2,
}  # fmt: skip


def chroma_inputs() -> dict[str, torch.Tensor]:
    """FLUX's inputs (no pooled text or guidance) with two rows' text masks of other lengths."""
    from diffserve.families.flux.tiny import flux_dit_inputs

    inputs = flux_dit_inputs(FLUX_GRID_H, FLUX_GRID_W, FLUX_TEXT_LEN, timesteps=[0.9, 0.3])
    del inputs["pooled_projections"], inputs["guidance"]
    lengths = torch.tensor([[2], [5]])
    inputs["text_mask"] = (torch.arange(FLUX_TEXT_LEN)[None, :] <= lengths).float()
    return inputs


# -------------------------------------------------------------------------------------- LongCat-Image

#: FLUX's block widths (so `flux_shards` checks its blocks too), without pooled text or guidance.
LONGCAT_IMAGE_CONFIG = {
    "patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 8,
    "num_attention_heads": 4, "joint_attention_dim": 24, "pooled_projection_dim": 24, "axes_dims_rope": [2, 2, 4],
}  # fmt: skip


def longcat_image_inputs() -> dict[str, torch.Tensor]:
    """FLUX's inputs without pooled text or guidance, the image tokens marked modality 1."""
    from diffserve.families.flux.tiny import flux_dit_inputs

    inputs = flux_dit_inputs(FLUX_GRID_H, FLUX_GRID_W, FLUX_TEXT_LEN, timesteps=[0.9, 0.3])
    del inputs["pooled_projections"], inputs["guidance"]
    inputs["img_ids"][:, 0] = 1
    return inputs


# ----------------------------------------------------------------------------------------- Qwen-Image

QWEN_CHANNELS, QWEN_TEXT_DIM, QWEN_HEAD_DIM = 16, 24, 16
QWEN_CONFIG = {
    "patch_size": 2, "in_channels": QWEN_CHANNELS, "out_channels": 4, "num_layers": 2,
    "attention_head_dim": QWEN_HEAD_DIM, "num_attention_heads": 4, "joint_attention_dim": QWEN_TEXT_DIM,
    "axes_dims_rope": [4, 6, 6],
}  # fmt: skip
QWEN_GRID = (1, 6, 5)  # (frames, rows, columns) in patches: 30 image tokens, not square
QWEN_TEXT_LEN, QWEN_REAL_TEXT = 7, (7, 4, 7)  # the second prompt is padded: 4 real tokens of 7
QWEN_TIMESTEPS = (0.9, 0.9, 0.3)  # a CFG-like pair, then a row at another timestep


def qwen_inputs() -> dict[str, object]:
    """Rows 0 and 1 share the latent and timestep (two prompts, the second padded); row 2 is at another t."""
    g = torch.Generator().manual_seed(1)
    batch = len(QWEN_TIMESTEPS)
    latents = torch.randn(batch, math.prod(QWEN_GRID), QWEN_CHANNELS, generator=g)
    latents[1] = latents[0]
    return {
        "hidden_states": latents,
        "encoder_hidden_states": torch.randn(batch, QWEN_TEXT_LEN, QWEN_TEXT_DIM, generator=g),
        "encoder_hidden_states_mask": torch.arange(QWEN_TEXT_LEN)[None, :]
        < torch.tensor(QWEN_REAL_TEXT)[:, None],
        "timestep": torch.tensor(QWEN_TIMESTEPS),
        "img_shapes": [[QWEN_GRID]] * batch,
    }


def qwen_shards(model: nn.Module, specs: Specs, state: State, rank: int) -> None:
    heads = (rank * 32, rank * 32 + 32)  # 2 of the 4 heads x 16
    mlp = (rank * 128, rank * 128 + 128)  # half of 4 x 64 MLP features
    attn = model.transformer_blocks[1].attn
    assert specs["transformer_blocks.1.attn.add_k_proj.weight"].ranges == (heads,)
    assert specs["transformer_blocks.1.attn.add_k_proj.bias"].ranges == (heads,)
    assert specs["transformer_blocks.0.attn.to_add_out.weight"].ranges == (heads,)
    assert specs["transformer_blocks.0.txt_mlp.net.2.weight"].ranges == (mlp,)
    assert isinstance(attn.to_v, ColumnParallelLinear) and isinstance(attn.to_out[0], RowParallelLinear)
    assert type(attn.norm_added_q) is RMSNorm and attn.norm_added_q.weight.shape == (QWEN_HEAD_DIM,)


def qwen_reference(model: nn.Module, inputs: dict[str, Any], out: torch.Tensor) -> None:
    """The prompts reach the image (the CFG rows differ), the padded row's mask matters (unmasked, its
    output changes; the unpadded row's does not)."""
    with torch.no_grad():
        unmasked = model(**dict(inputs, encoder_hidden_states_mask=None))
    scale = out.abs().max()
    assert (out[0] - out[1]).abs().max() > 1e-2 * scale
    assert (unmasked[1] - out[1]).abs().max() > 1e-3 * scale
    assert torch.equal(unmasked[0], out[0])


# -------------------------------------------------------------------------------------------- Z-Image

ZIMAGE_CAP_DIM, ZIMAGE_CHANNELS, ZIMAGE_HEADS, ZIMAGE_HEAD_DIM = 24, 4, 4, 16
ZIMAGE_CONFIG = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": ZIMAGE_CHANNELS,
    "dim": ZIMAGE_HEADS * ZIMAGE_HEAD_DIM, "n_layers": 2, "n_refiner_layers": 1, "n_heads": ZIMAGE_HEADS,
    "n_kv_heads": ZIMAGE_HEADS, "cap_feat_dim": ZIMAGE_CAP_DIM, "axes_dims": [4, 6, 6],
    "axes_lens": [256, 64, 64],
}  # fmt: skip
ZIMAGE_HIDDEN = 170  # the SwiGLU width int(64 * 8 / 3): 85 features per rank at TP 2, not divisible by 4
#: (latent (F, H, W), caption tokens, t) per row: non-square latents of two sizes, two caption lengths.
ZIMAGE_ROWS = (((1, 8, 12), 40, 0.3), ((1, 10, 6), 5, 0.7))


def z_image_inputs() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    return {
        "x": [torch.randn(ZIMAGE_CHANNELS, *size, generator=g) for size, _, _ in ZIMAGE_ROWS],
        "t": torch.tensor([t for _, _, t in ZIMAGE_ROWS]),
        "cap_feats": [torch.randn(n, ZIMAGE_CAP_DIM, generator=g) for _, n, _ in ZIMAGE_ROWS],
    }


def z_image_shards(model: nn.Module, specs: Specs, state: State, rank: int) -> None:
    # q/k/v/out + w1/w2/w3 in each of the 4 blocks (2 main layers, 1 noise refiner, 1 context refiner).
    assert len(specs) == 4 * 7
    assert {k.split(".")[0] for k in specs} == {"layers", "noise_refiner", "context_refiner"}
    heads = (rank * 32, rank * 32 + 32)  # 2 of the 4 heads x 16
    features = (rank * 85, rank * 85 + 85)
    assert specs["context_refiner.0.attention.to_k.weight"].ranges == (heads,)
    assert specs["context_refiner.0.attention.to_k.weight"].dim == 0
    assert specs["layers.1.attention.to_out.0.weight"].ranges == (heads,)
    assert specs["layers.1.attention.to_out.0.weight"].dim == 1
    assert specs["noise_refiner.0.feed_forward.w3.weight"].ranges == (features,)
    assert specs["noise_refiner.0.feed_forward.w2.weight"].ranges == (features,)
    assert specs["noise_refiner.0.feed_forward.w2.weight"].dim == 1
    assert state["layers.0.attention.norm_q.weight"].shape == (ZIMAGE_HEAD_DIM,)


# ------------------------------------------------------------------------------------------------ Wan

WAN_CHANNELS, WAN_TEXT_DIM, WAN_IMAGE_DIM, WAN_HEADS, WAN_HEAD_DIM = 4, 16, 12, 4, 12
WAN_CONFIG = {
    "patch_size": [1, 2, 2], "num_attention_heads": WAN_HEADS, "attention_head_dim": WAN_HEAD_DIM,
    "in_channels": WAN_CHANNELS, "out_channels": WAN_CHANNELS, "text_dim": WAN_TEXT_DIM, "freq_dim": 16,
    "ffn_dim": 48, "num_layers": 2, "image_dim": WAN_IMAGE_DIM, "added_kv_proj_dim": WAN_HEADS * WAN_HEAD_DIM,
}  # fmt: skip
WAN_BATCH, WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH = 3, 3, 6, 10  # post-patch grid 3 x 3 x 5: 45 tokens
WAN_TEXT_LEN, WAN_IMAGE_LEN = 7, 5


def wan_inputs() -> dict[str, torch.Tensor]:
    """A CFG-like pair (one latent, two texts, one timestep) plus a row at another timestep, I2V."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(WAN_BATCH, WAN_CHANNELS, WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH, generator=g)
    latents[1] = latents[0]
    return {
        "hidden_states": latents,
        "timestep": torch.tensor([700.0, 700.0, 250.0]),
        "encoder_hidden_states": torch.randn(WAN_BATCH, WAN_TEXT_LEN, WAN_TEXT_DIM, generator=g),
        "encoder_hidden_states_image": torch.randn(WAN_BATCH, WAN_IMAGE_LEN, WAN_IMAGE_DIM, generator=g),
    }


def wan_shards(model: nn.Module, specs: Specs, state: State, rank: int) -> None:
    half = (rank * 24, rank * 24 + 24)  # 2 of the 4 heads x 12
    assert specs["blocks.0.attn1.norm_q.weight"].ranges == (half,)
    assert specs["blocks.1.attn2.norm_added_k.weight"].ranges == (half,)
    assert specs["blocks.0.attn2.to_out.0.weight"].ranges == (half,)
    assert model.blocks[0].attn1.num_heads == model.blocks[0].attn2.num_heads == 2


def wan_norm_errors(state: ParallelState) -> dict[str, float]:
    """`ParallelRMSNorm` on this rank's half of the features against the full-width RMSNorm's same half,
    in fp32 and in bf16 (relative to the output's largest magnitude)."""
    torch.manual_seed(3)
    whole = RMSNorm(16, eps=1e-6, round_once=True)
    nn.init.normal_(whole.weight)
    x = torch.randn(2, 5, 16) * 3
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference = copy.deepcopy(whole).to(dtype)
        sharded = ParallelRMSNorm.replacing(reference, state)
        spec = sharded.shard_specs()["weight"]
        sharded.load_state_dict({"weight": spec.take(reference.weight.detach())})
        ((lo, hi),) = spec.ranges
        want = reference(x.to(dtype))[..., lo:hi].float()
        got = sharded(x.to(dtype)[..., lo:hi])
        assert got.dtype == dtype, got.dtype
        errors[str(dtype)] = ((got.float() - want).abs().max() / want.abs().max()).item()
    return errors


# ------------------------------------------------------------------------------------------ SD3 / SD3.5

SD3_CHANNELS, SD3_TEXT_DIM, SD3_POOLED_DIM, SD3_HEADS, SD3_HEAD_DIM = 4, 16, 12, 4, 8
SD3_INNER = SD3_HEADS * SD3_HEAD_DIM
SD3_CONFIG = {
    "sample_size": 8, "patch_size": 2, "in_channels": SD3_CHANNELS, "num_layers": 3,
    "attention_head_dim": SD3_HEAD_DIM, "num_attention_heads": SD3_HEADS, "joint_attention_dim": SD3_TEXT_DIM,
    "caption_projection_dim": SD3_INNER, "pooled_projection_dim": SD3_POOLED_DIM,
    "out_channels": SD3_CHANNELS, "pos_embed_max_size": 16, "dual_attention_layers": [0, 2],
    "qk_norm": "rms_norm",
}  # fmt: skip
SD3_BATCH, SD3_HEIGHT, SD3_WIDTH, SD3_TEXT_LEN = 3, 12, 10, 7  # patch 2: a 6x5 grid of image tokens


def sd3_inputs() -> dict[str, torch.Tensor]:
    """A CFG-like pair (one latent, two prompts, one timestep) plus a row at another timestep."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(SD3_BATCH, SD3_CHANNELS, SD3_HEIGHT, SD3_WIDTH, generator=g)
    latents[1] = latents[0]
    return {
        "hidden_states": latents,
        "encoder_hidden_states": torch.randn(SD3_BATCH, SD3_TEXT_LEN, SD3_TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(SD3_BATCH, SD3_POOLED_DIM, generator=g),
        "timestep": torch.tensor([700.0, 700.0, 250.0]),
    }


def sd3_shards(model: nn.Module, specs: Specs, state: State, rank: int) -> None:
    # The last block has no to_add_out and no text MLP.
    assert not any(k.startswith("transformer_blocks.2.ff_context") for k in specs)
    half = (rank * SD3_INNER // 2, (rank + 1) * SD3_INNER // 2)  # 2 of the 4 heads x 8
    assert specs["transformer_blocks.0.attn.add_k_proj.weight"].ranges == (half,)
    assert specs["transformer_blocks.1.attn.to_add_out.weight"].ranges == (half,)
    assert specs["transformer_blocks.2.attn2.to_out.0.weight"].ranges == (half,)
    assert specs["transformer_blocks.1.ff_context.net.0.proj.bias"].ranges == ((rank * 64, rank * 64 + 64),)
    last = model.transformer_blocks[2]
    assert isinstance(last.attn.add_v_proj, ColumnParallelLinear) and last.attn.to_add_out is None
    assert isinstance(last.attn2.to_out[0], RowParallelLinear) and last.ff_context is None
    assert type(last.attn.norm_added_k) is RMSNorm and last.attn.norm_added_k.weight.shape == (SD3_HEAD_DIM,)


def sd3_reference(model: nn.Module, inputs: dict[str, Any], out: torch.Tensor) -> None:
    """The prompts and the timesteps reach the image: a shard that lost either could not pass the parity."""
    assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max()
    assert (out[0] - out[2]).abs().max() > 1e-2 * out.abs().max()


# ------------------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    cls: type[nn.Module]
    config: dict[str, object]
    inputs: Callable[[], dict[str, Any]]
    #: The sharded forward's max abs error must stay below this fraction of the output's max |value|.
    tolerance: float
    meshes: tuple[str, ...]
    #: How many weight tensors TP 2 shards.
    sharded_weights: int
    #: The family's own checks of rank `rank`'s shards: (model, specs, state dict, rank).
    shards: Callable[[nn.Module, Specs, State, int], None]
    #: What loading it over 3 TP ranks raises (a regex).
    refused_over_3: str
    #: The one-device output's shape, when the test pins it.
    out_shape: tuple[int, ...] | None = None
    #: Layer-level checks run on the TP-only ranks before the DiT's forward: errors by name...
    layer_errors: Callable[[ParallelState], dict[str, float]] | None = None
    #: ... and each one's bound.
    layer_bounds: dict[str, float] = field(default_factory=dict)
    #: The reference is loaded by the component loader (as the engine loads it) instead of the same
    #: steps as the ranks'.
    reference_by_loader: bool = False
    #: What the parity relies on in the one-device output: (model, inputs, output).
    reference_checks: Callable[[nn.Module, dict[str, Any], Any], None] | None = None


FAMILIES = {
    # fp32 below: the row-parallel all-reduces only reorder the output projections' sums.
    "flux": Family(
        FluxTransformer2DModel, FLUX_CONFIG, flux_inputs, 1e-5, ("tp2", "tp2xulysses2"),
        # 2 double-stream blocks x (6 q/k/v + 2 out + 2 x 2 MLP) + 2 single x (4 columns + proj_out).
        sharded_weights=2 * 12 + 2 * 5, shards=flux_shards,
        refused_over_3="the FLUX DiT's 4 attention heads do not divide over 3",
        layer_errors=flux_layer_errors, layer_bounds={"column": 1e-6, "row": 1e-6},
        reference_by_loader=True,
    ),
    "chroma": Family(
        ChromaTransformer2DModel, CHROMA_CONFIG, chroma_inputs, 1e-5, ("tp2",),
        # As FLUX's blocks: the approximator, embedders and output head stay whole.
        sharded_weights=2 * 12 + 2 * 5, shards=flux_shards,
        refused_over_3="--tp-size 3: the Chroma DiT's 4 attention heads do not divide over 3",
    ),
    "longcat-image": Family(
        LongCatImageTransformer2DModel, LONGCAT_IMAGE_CONFIG, longcat_image_inputs, 1e-5, ("tp2",),
        # As FLUX's blocks: the timestep embedding, embedders and output head stay whole.
        sharded_weights=2 * 12 + 2 * 5, shards=flux_shards,
        refused_over_3="--tp-size 3: the LongCat-Image DiT's 4 attention heads do not divide over 3",
    ),
    "qwen-image": Family(
        QwenImageTransformer2DModel, QWEN_CONFIG, qwen_inputs, 2e-6, ("tp2",),
        # Per block: 6 q/k/v (image and text) + to_out.0 + to_add_out + 2 MLPs x 2.
        sharded_weights=2 * 12, shards=qwen_shards,
        refused_over_3=r"--tp-size 3: the Qwen-Image DiT's 4 attention heads do not divide",
        out_shape=(len(QWEN_TIMESTEPS), math.prod(QWEN_GRID), 2 * 2 * 4), reference_checks=qwen_reference,
    ),
    # A few ulps of |out|.
    "z-image": Family(
        ZImageTransformer2DModel, ZIMAGE_CONFIG, z_image_inputs, 1e-6, ("tp2",),
        sharded_weights=4 * 7, shards=z_image_shards,
        refused_over_3="--tp-size 3: the Z-Image DiT's 4 attention heads do not divide",
    ),
    "wan": Family(
        WanTransformer3DModel, WAN_CONFIG, wan_inputs, 1e-5, ("tp2", "tp2xulysses2"),
        # Per block: self q/k/v/out + 2 norms, cross q/k/v/out + image k/v + 3 norms, FFN 2.
        sharded_weights=2 * 17, shards=wan_shards,
        refused_over_3="the Wan DiT's 4 attention heads do not divide over 3",
        # The all-reduced sum only reorders fp32 additions; bf16 rounds once, as F.rms_norm does.
        layer_errors=wan_norm_errors, layer_bounds={"torch.float32": 1e-6, "torch.bfloat16": 2**-7},
    ),
    "sd3": Family(
        SD3Transformer2DModel, SD3_CONFIG, sd3_inputs, 1e-5, ("tp2",),
        # Joint attention 6 q/k/v + to_out + to_add_out, attn2 3 + 1, MLPs 2 + 2; the last block has no
        # to_add_out and no text MLP. Blocks: 0 dual (16), 1 plain (12), 2 last and dual (13).
        sharded_weights=16 + 12 + 13, shards=sd3_shards,
        refused_over_3=r"--tp-size 3: the SD3 DiT's 4 attention heads do not divide",
        out_shape=(SD3_BATCH, SD3_CHANNELS, SD3_HEIGHT, SD3_WIDTH), reference_checks=sd3_reference,
    ),
}  # fmt: skip


def build_meta(family: str, **config: object) -> nn.Module:
    with torch.device("meta"):
        return FAMILIES[family].cls.from_config({**FAMILIES[family].config, **config})


def load_dit(family: str, directory: Path, tp: LoadOnlyRank | ParallelState | None) -> nn.Module:
    """The loader's steps (without importing the component loader, which imports transformers: seconds
    per rank process): build on meta, shard when `tp` is given, read the (shard's) weights, fuse."""
    model = build_meta(family)
    if tp is not None:
        model.shard_for_tensor_parallel(tp)
    load_safetensors_into(model, [directory / WEIGHTS], torch.device("cpu"), torch.float32)
    model.eval()
    if hasattr(model, "fuse_for_inference"):
        model.fuse_for_inference()
    return model


def load_by_component_loader(family: str, directory: Path, tp: LoadOnlyRank | None) -> nn.Module:
    """The DiT as the component loader loads it (sharded when `tp` is given, then fused)."""
    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms.cpu import CpuPlatform

    cls = FAMILIES[family].cls
    spec = ComponentSpec("transformer", "diffusers", cls.__name__, directory)
    module, _ = load_native_model(spec, cls, CpuPlatform(), torch.float32, tp)
    assert isinstance(module, cls)
    return module


def load_reference(family: str, directory: Path) -> nn.Module:
    if FAMILIES[family].reference_by_loader:
        return load_by_component_loader(family, directory, None)
    return load_dit(family, directory, None)


def sharded_bytes(family: str) -> int:
    """fp32 bytes of the checkpoint tensors TP shards (attention and MLP projections, Wan's QK-norms)."""
    model = build_meta(family)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))
    return sum(4 * math.prod(spec.full_shape) for spec in tensor_parallel_shards(model).values())


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def as_list(out: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """A DiT's output as a list (Z-Image returns one tensor per sample)."""
    return out if isinstance(out, list) else [out]


@pytest.fixture(scope="module")
def dit_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A family's seeded transformer folder (config.json + safetensors; made once), weights large enough
    that every block matters. SD3's position table is a buffer: it keeps its sincos values."""
    from diffserve.testing.tiny_writing import save_diffusers_model

    dirs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in dirs:
            spec = FAMILIES[family]
            torch.manual_seed(0)
            model = spec.cls.from_config(spec.config)
            for p in model.parameters():
                nn.init.normal_(p, std=0.2)
            directory = tmp_path_factory.mktemp(f"tp-{family}") / "transformer"
            save_diffusers_model(model, directory, spec.cls.__name__, spec.config)
            dirs[family] = directory
        return dirs[family]

    return get


# ----------------------------------------------------------------------------------- in this process


class ReadSpy:
    """Wraps the loader's `open_safetensors`: records whole-tensor reads, sliced reads and their bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.whole: list[str] = []
        self.slices: dict[str, list[tuple[slice, ...]]] = {}
        self.bytes = 0
        real_open = safetensors_weights.open_safetensors
        spy = self

        class SpySlice:
            def __init__(self, inner, key: str) -> None:
                self.inner, self.key = inner, key

            def get_shape(self) -> list[int]:
                return self.inner.get_shape()

            def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
                spy.slices.setdefault(self.key, []).append(index)
                out = self.inner[index]
                spy.bytes += out.numel() * out.element_size()
                return out

        class SpyFile:
            def __init__(self, inner) -> None:
                self.inner = inner

            def __enter__(self) -> SpyFile:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)

            def keys(self) -> list[str]:
                return self.inner.keys()

            def get_tensor(self, key: str) -> torch.Tensor:
                spy.whole.append(key)
                out = self.inner.get_tensor(key)
                spy.bytes += out.numel() * out.element_size()
                return out

            def get_slice(self, key: str) -> SpySlice:
                return SpySlice(self.inner.get_slice(key), key)

        monkeypatch.setattr(
            safetensors_weights, "open_safetensors", lambda *a, **kw: SpyFile(real_open(*a, **kw))
        )


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_only_its_shard(
    dit_dirs, monkeypatch: pytest.MonkeyPatch, family: str, rank: int
) -> None:
    full = load_file(str(dit_dirs(family) / WEIGHTS))
    model = build_meta(family)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, rank))
    specs = tensor_parallel_shards(model)
    spy = ReadSpy(monkeypatch)
    num_bytes = load_safetensors_into(model, [dit_dirs(family) / WEIGHTS], "cpu", torch.float32)

    assert len([k for k in specs if k.endswith(".weight")]) == FAMILIES[family].sharded_weights
    assert not set(spy.whole) & set(specs), "a sharded tensor was read whole"
    assert set(spy.slices) == set(specs)
    state = model.state_dict()
    for key, spec in specs.items():
        assert spy.slices[key] == spec.indices(), key
        assert torch.equal(state[key], spec.take(full[key])), key
    for key in full.keys() - specs.keys():  # replicated: embedders, adaLN, norms, row biases, output head
        assert torch.equal(state[key], full[key]), key
    FAMILIES[family].shards(model, specs, state, rank)

    sharded_full = sum(full[k].numel() * 4 for k in specs)
    sharded_here = sum(state[k].numel() * 4 for k in specs)
    whole = sum(t.numel() * 4 for k, t in full.items() if k not in specs)
    assert sharded_here * 2 == sharded_full  # each rank holds half of every sharded tensor
    assert num_bytes == spy.bytes == sharded_here + whole  # and read nothing else from them
    # The loader read this rank's slices of the sharded tensors and nothing more (it counts what it read).
    assert num_bytes == sum(t.numel() * 4 for t in state.values())
    assert num_bytes < sum(t.numel() * 4 for t in full.values())
    print(f"{family} rank {rank}: read {num_bytes} of {sharded_full + whole} bytes")


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_that_do_not_divide_the_tp_size_are_refused(dit_dirs, family: str) -> None:
    with pytest.raises(ModelLoadError, match=FAMILIES[family].refused_over_3):
        load_by_component_loader(family, dit_dirs(family), LoadOnlyRank(3, 0))


@pytest.mark.parametrize(
    ("family", "config", "match"),
    [
        ("z-image", {}, f"MLP hidden width {ZIMAGE_HIDDEN} .* does not divide over 4"),
        ("wan", {"ffn_dim": 50}, "FFN width ffn_dim=50 does not divide over 4"),
    ],
    ids=["z-image", "wan"],
)
def test_an_mlp_width_that_does_not_divide_is_refused(family: str, config: dict, match: str) -> None:
    model = build_meta(family, **config)
    with pytest.raises(ValueError, match=match):
        model.shard_for_tensor_parallel(LoadOnlyRank(4, 0))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_loaded_model_cannot_be_sharded(dit_dirs, family: str) -> None:
    model = load_reference(family, dit_dirs(family))
    with pytest.raises(RuntimeError, match="before loading"):
        model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))


def test_a_sharded_tensor_of_another_full_shape_is_refused_naming_it(dit_dirs, tmp_path: Path) -> None:
    """The shard's ranges are checked against the checkpoint's full shape before anything is sliced."""
    model = build_meta("flux", num_layers=1, num_single_layers=0)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))
    full = load_file(str(dit_dirs("flux") / WEIGHTS))
    tensors = {k: v for k, v in full.items() if not k.startswith(("transformer_blocks.1.", "single_"))}
    tensors["transformer_blocks.0.attn.to_q.weight"] = torch.zeros(40, 32)  # not (32, 32)
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'transformer_blocks.0.attn.to_q.weight' has shape \(40, 32\)"):
        load_safetensors_into(model, [tmp_path / "w.safetensors"], torch.device("cpu"), torch.float32)


def test_only_an_rms_norm_with_its_rounding_is_sharded() -> None:
    with pytest.raises(TypeError, match="round_once=True"):
        ParallelRMSNorm.replacing(RMSNorm(8, round_once=False), LoadOnlyRank(2, 0))
    with pytest.raises(TypeError, match="affine RMSNorm"):
        ParallelRMSNorm.replacing(RMSNorm(8, elementwise_affine=False, round_once=True), LoadOnlyRank(2, 0))


@pytest.fixture(scope="module")
def one_device(dit_dirs) -> Callable[[str], tuple[Any, int, nn.Module]]:
    """A family's one-device output, its parameter bytes and the model (computed once)."""
    cache: dict[str, tuple[Any, int, nn.Module]] = {}

    def get(family: str) -> tuple[Any, int, nn.Module]:
        if family not in cache:
            model = load_reference(family, dit_dirs(family))
            with torch.no_grad():
                out = model(**FAMILIES[family].inputs())
            cache[family] = (out, param_bytes(model), model)
        return cache[family]

    return get


CHECKED_REFERENCES = [name for name, family in FAMILIES.items() if family.reference_checks is not None]


@pytest.mark.parametrize("family", CHECKED_REFERENCES)
def test_the_inputs_reach_the_one_device_output(one_device, family: str) -> None:
    out, _, model = one_device(family)
    FAMILIES[family].reference_checks(model, FAMILIES[family].inputs(), out)


# ------------------------------------------------------------------------------------- on gloo ranks


def forward_on_rank(
    rank: int, world_size: int, ulysses: int, work: dict[str, tuple[Path, dict[str, Any]]]
) -> dict[str, CaseResult]:
    """The TP forward of every family in `work` ({family: (folder, inputs)}) on this rank, with the
    family's layer checks on a TP-only mesh."""
    config = ParallelConfig(num_gpus=world_size, tp_size=2, ulysses_degree=ulysses)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))

    def forward(name: str) -> dict[str, object]:
        family, (directory, inputs) = FAMILIES[name], work[name]
        with torch.no_grad():
            errors = family.layer_errors(state) if family.layer_errors and ulysses == 1 else {}
            model = load_dit(name, directory, state)
            with parallel_scope(state):
                out = model(**inputs)
        return {"errors": errors, "out": out, "param_bytes": param_bytes(model)}

    return case_results(forward, work)


@pytest.fixture(scope="module")
def tp_outputs(dit_dirs) -> MeshRuns:
    """A family's results by rank on a mesh: one `run_distributed` per mesh, for every family tested on it."""

    def start(mesh: str) -> list[dict[str, CaseResult]]:
        world_size, ulysses = MESHES[mesh]
        work = {name: (dit_dirs(name), f.inputs()) for name, f in FAMILIES.items() if mesh in f.meshes}
        return run_distributed(forward_on_rank, world_size, ulysses, work, timeout_s=240)

    return MeshRuns(start)


CASES = [(name, mesh) for name, family in FAMILIES.items() for mesh in family.meshes]


@pytest.mark.parametrize(("family", "mesh"), CASES, ids=[f"{name}-{mesh}" for name, mesh in CASES])
def test_tp_dit_equals_one_device(one_device, tp_outputs, family: str, mesh: str) -> None:
    spec = FAMILIES[family]
    out, whole_bytes, _ = one_device(family)
    expected = as_list(out)
    scale = max(e.abs().max().item() for e in expected)
    if spec.out_shape is not None:
        assert out.shape == spec.out_shape
    _, ulysses = MESHES[mesh]
    for rank, result in enumerate(tp_outputs(family, mesh)):
        assert result["errors"].keys() == (spec.layer_bounds.keys() if ulysses == 1 else set())
        for layer, error in result["errors"].items():
            assert error < spec.layer_bounds[layer], (layer, error)
        outs = as_list(result["out"])
        assert [o.shape for o in outs] == [e.shape for e in expected]
        error = max((o - e).abs().max().item() for o, e in zip(outs, expected, strict=True))
        print(f"{family} tp 2 x ulysses {ulysses}, rank {rank}: max abs error {error:.2e} "
              f"(max |out| {scale:.2f}), params {result['param_bytes']} of {whole_bytes} bytes")  # fmt: skip
        assert error < spec.tolerance * scale, error
        # Half of every sharded tensor, all of the replicated ones.
        assert result["param_bytes"] == whole_bytes - sharded_bytes(family) // 2
